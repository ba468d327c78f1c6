"""Pure decision functions (installed as baige_ray.policies): observations in, decisions out, no Ray."""
