"""The model_index.json `_class_name`s of Qwen-Image directories, apart from their loader
(qwen_image_dir.py): the family registry recognises a directory by them without importing the model."""

PIPELINE_CLASS = "QwenImagePipeline"
EDIT_PIPELINE_CLASS = "QwenImageEditPipeline"
PIPELINE_CLASSES = (PIPELINE_CLASS, EDIT_PIPELINE_CLASS)
