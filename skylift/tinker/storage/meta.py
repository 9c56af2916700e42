"""The metadata file written beside every Tinker checkpoint's weights (model config, steps, public).

Its own module so that the training backend can name it without importing the store (SQLAlchemy,
Alembic): the GPU check runs the backend on machines that have neither.
"""

META_FILE = "skylift_tinker_meta.json"
