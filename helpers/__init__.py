"""Shared code for the course 'Scaling PyTorch training with Ray'.

Notebooks start with `from helpers import setup; cfg = setup()`.
"""

from helpers.config import ConfigError, CourseConfig, load_config
from helpers.session import setup

__all__ = ["ConfigError", "CourseConfig", "load_config", "setup"]
