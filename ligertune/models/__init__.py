"""The model a recipe trains: `build` (from weights or a config), `families` (the one place that
says which Hugging Face classes make up each model family) and `architectures` (the shipped
random-init configs). Import from the modules: the family table and the architectures are plain
data that the recipe schema and the patcher read without importing torch."""
