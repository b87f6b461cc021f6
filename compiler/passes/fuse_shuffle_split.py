"""A channel shuffle whose only reader is a split along the channels (ShuffleNetV2: each
unit's shuffle feeds the next unit's chunk) becomes one channel_shuffle node writing the
split's parts (attrs sizes, runtime/kernels/shape.py): one copy of the tensor instead of
two, and the shuffled tensor takes no arena space."""

from pmx.compiler.rewrite import N, V, rule, rule_pass

SHUFFLE = N("channel_shuffle", name="shuffle", where=lambda shuffle, m: "sizes" not in shuffle.attrs)


@rule(N("split", V("s", SHUFFLE, sole=True), outs=None, name="split",
        where=lambda split, m: m.s.shape is not None and split.attrs["axis"] % len(m.s.shape) == 1))
def shuffle_into_parts(graph, m):
    """The shuffled tensor has no other reader, so it need not exist."""
    graph.remove_node(m.split)
    graph.set_outputs(m.shuffle, m.split.outputs)
    m.shuffle.attrs["sizes"] = tuple(int(k) for k in m.split.attrs["sizes"])
    return True


fuse_shuffle_split = rule_pass("fuse_shuffle_split", [shuffle_into_parts])
