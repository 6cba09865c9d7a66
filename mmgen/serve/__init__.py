"""`mmgen serve`: an OpenAI-compatible video and image server over one loaded pipeline.

protocol.py (the HTTP shapes and the request checks), queue.py (the SQLite job store), worker.py
(the thread that owns the pipeline), service.py (what the routes call), metrics.py (Prometheus),
app.py (the FastAPI routes), cli.py (the `serve` subcommand), page.html (the web page at `/`).
"""
