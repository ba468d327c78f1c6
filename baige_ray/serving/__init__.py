"""Ray Serve hosting of trained models and the train/infer device pool."""
