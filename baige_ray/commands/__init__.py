"""The `baige-ray` subcommands, one module each (registered by baige_ray/cli.py): the top of the
stack, free to use any layer below."""
