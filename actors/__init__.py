"""Ray actor classes (installed as baige_ray.actors)."""
