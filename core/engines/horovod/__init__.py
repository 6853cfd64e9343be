"""The Horovod engine: its timeline reader and merge (``timeline``)."""
