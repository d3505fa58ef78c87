"""DiLoCo and Streaming DiLoCo: local inner steps and a compressed outer exchange."""
