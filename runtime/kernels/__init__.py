"""Kernels: one family file per group of ops, each registering its ops' factories and
shape rules in the registry (registry.py) when imported. A factory gets the binding's
BindContext (bind.py: shared scratch, persistent buffers, temporaries, worker pool);
common.py holds the helpers the families share.

The registry imports a family when a lookup first needs one of its ops (registry.FAMILIES
lists them all); registering a name twice is an error. No family imports this package's
namespace: each imports the modules it uses by their full path.
"""
