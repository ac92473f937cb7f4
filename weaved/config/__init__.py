"""Configuration: deployment profiles (``profile`` dataclasses, ``load`` from TOML through ``tables``)
and the hardware they are resolved against (``hardware``)."""
