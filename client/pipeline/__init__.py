"""Pipeline training: the model cut into stages, the workers that serve them, the trainers that route
microbatches through them, and discovery over hivemind's DHT. See ``trainer.py`` for the flow of a step."""
