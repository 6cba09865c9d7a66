"""The tile contract between the low-rank dispatcher (low_rank) and its Triton kernels (triton_low_rank).

Its own module so that both import it and neither imports the other at load time: low_rank must load
without Triton, and triton_low_rank is imported (lazily, Triton being optional) only by low_rank.
"""

GROUP_ALIGN = 256  # a multiple of every BLOCK_N of the Triton kernels (their tiles then stay in one layer)
