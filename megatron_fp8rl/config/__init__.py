"""The run configuration: one dataclass tree, built once at the entry point and passed down.

Owns: loading a YAML file plus dotted command-line overrides into a typed dataclass tree,
validation errors that name the key, and saving the effective config. Each component defines its
own config dataclass next to its code; this package only assembles and loads them.
Must not import: models, convert, rollout, data, trainer, cli (layer L1 imports only L0).
"""
