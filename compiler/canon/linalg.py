"""Linear algebra: nn.Linear / F.linear -> linear; matmul spellings -> matmul."""

from pmx.compiler.canon import data_input, fail, make, rule, weight


@rule("nn.Linear", "F.linear")
def linear(node, ctx):
    x = data_input(node)
    w = weight(node, "weight")
    b = weight(node, "bias", required=False)
    if w.shape is None or len(w.shape) != 2 or x.shape is None or x.shape[-1] != w.shape[1]:
        fail(node, f"input {x.shape} does not match weight {w.shape} (expected input [..., {w.shape[1] if w.shape else '?'}])")
    return [make(node, "linear", [x, w] + ([b] if b is not None else []))]


@rule("torch.matmul", "torch.mm", "torch.bmm", "Tensor.matmul")
def matmul(node, ctx):
    a = data_input(node, "input", 0)
    b = node.named_input("other") or node.named_input("mat2") or data_input(node, "other", 1)
    return [make(node, "matmul", [a, b])]
