"""embedjob: images and videos in Parquet datasets to vision-encoder embeddings."""

__version__ = "0.1.0"
