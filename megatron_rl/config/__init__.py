"""Recipe configuration: typed schema, YAML loader with inheritance and overrides."""

from .errors import ConfigError, Problem
from .loader import dump_yaml, load_raw, load_recipe, parse_override, to_dict, write_resolved
from .schema import RecipeConfig

__all__ = ["ConfigError", "Problem", "RecipeConfig", "dump_yaml", "load_raw", "load_recipe",
           "parse_override", "to_dict", "write_resolved"]
