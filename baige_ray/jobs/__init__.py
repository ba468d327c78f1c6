"""The jobs a user starts, `fit` and `launch`: the top of the stack, above the actor classes they start."""
