"""The tiny DeepSeek-V3-shaped target the demo and the tests train on, built here (no download)."""
