"""Warm starts of the tiny model on Gym-shipped tool environments (the library never imports this).

`session_counter`: synthetic transcripts of Gym's `example_session_state_mgmt` (a stateful counter:
increment twice, read it back) with the environment's own tools; `warm_start`: the tiny model
fine-tuned briefly on them (`model.tiny_corpus: gym_session_counter` in a recipe).
"""
