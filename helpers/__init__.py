"""Shared code for the course 'Scaling PyTorch training with Ray'.

Notebooks start with `from helpers import setup; cfg = setup()`. The modules here are the ones lessons import or
show; `helpers.tooling` holds the code the course runs but does not teach.
"""

from helpers.config import ConfigError, CourseConfig, load_config
from helpers.session import setup

__all__ = ["ConfigError", "CourseConfig", "load_config", "setup"]
