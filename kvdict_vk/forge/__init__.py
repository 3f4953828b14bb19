"""Forge: the producer side (real model, learning, certification). The engine never imports it."""
