"""pnnx's list and size expressions (index lists `[None,@0]`, expand's size lists
`[size(@0,0),3]`, arange's `size(@0,1)`): the pnnx expression reader turns them into trees,
and the canonicalization rules match the trees. First the reader on its own, then small
graphs written as pnnx writes them, compiled and run, and the errors they raise."""

import numpy as np
import pytest
from paramgraph import compile_lines

from pmx.compiler.canon.math_ops import LIST, NONE, pnnx_expression_tree, pnnx_text
from pmx.runtime import expr as E
from pmx.runtime.errors import PmxCompileError, PmxFormatError


def lit(v):
    return ("#", v)


def size(k, d):
    return ("size", E.at(k), lit(d))


READS = [
    ("[None,@0]", (LIST, NONE, E.at(0))),
    ("[None,[1,2],@0]", (LIST, NONE, (LIST, lit(1), lit(2)), E.at(0))),
    ("[[0,1],None,[3,-2]]", (LIST, (LIST, lit(0), lit(1)), NONE, (LIST, lit(3), lit(-2)))),
    (
        "[[True,False],[False,True,True]]",
        (LIST, (LIST, lit(True), lit(False)), (LIST, lit(False), lit(True), lit(True))),
    ),
    ("[size(@0,0),3,size(@0,2)]", (LIST, size(0, 0), lit(3), size(0, 2))),
    ("size(@1,-1)", size(1, -1)),
    ("[int(size(@0,1)),-1]", (LIST, ("int", size(0, 1)), lit(-1))),
    ("mul(torch.float(size(@0,1)),5.000000e-01)", ("mul", ("torch.float", size(0, 1)), lit(0.5))),
    ("[]", (LIST,)),
    ("[[],[[None]]]", (LIST, (LIST,), (LIST, (LIST, NONE)))),
    (" [ None , @1 ] ", (LIST, NONE, E.at(1))),
    ("[neg,@0,1]", (LIST, ("neg", E.at(0)), lit(1))),  # prefix reading inside a list, as pnnx's
    ("add(@0,1)", ("add", E.at(0), lit(1))),
]


@pytest.mark.parametrize("text,tree", READS)
def test_reader_builds_list_and_size_trees(text, tree):
    got = pnnx_expression_tree(text, 2)
    assert got == tree
    assert pnnx_expression_tree(pnnx_text(got), 2) == got  # pnnx_text spells what the reader reads


def test_reader_keeps_bools_and_ints_apart():
    got = pnnx_expression_tree("[1,True,[0,False]]", 0)
    assert [type(e[1]) for e in (got[1], got[2], got[3][1], got[3][2])] == [int, bool, int, bool]


def test_reader_depth_limit_is_expressions_limit():
    d = E.MAX_DEPTH
    assert pnnx_expression_tree("[" * d + "]" * d, 0)[0] == LIST
    with pytest.raises(PmxFormatError, match="deeper"):
        pnnx_expression_tree("[" * (d + 1) + "]" * (d + 1), 0)


@pytest.mark.parametrize(
    "text,why",
    [
        ("[None,@0", "unclosed"),
        ("[None,@0]]", "unbalanced"),
        ("[1,2)", "unbalanced"),
        ("(1,2]", "follows no function"),
        ("size(@0,1", "unclosed"),
        ("[@0](1)", "follows no function"),
        ("[None(@0)]", "follows no function"),
        ("[bogus]", "unknown token"),
        ("[None,@0x]", "unknown token"),
        ("[1.5.5]", "unknown token"),
        ("[list]", "unknown token"),
        ("neg,[1]", "list is no operand"),
        ("size([1,2],0)", "list is no operand"),
        ("[1],neg", "takes 1 operands"),
        ("size(@0)", "takes 2 operands"),
        ("[@0,@2]", "uses @2"),
        ("[1][2]", "holds 2 values"),
        ("", "holds 0 values"),
        ("[" + "1," * E.MAX_EXPR_LENGTH + "1]", "longer than"),
        ("size(" * 300 + "@0" + ",0)" * 300, "deeper"),
    ],
)
def test_reader_refuses_malformed_lists(text, why):
    with pytest.raises(PmxFormatError, match=why):
        pnnx_expression_tree(text, 2)


# --- graphs as pnnx writes them ------------------------------------------------------------


def compile_and_run(tmp_path, ops, feeds):
    """Compile `ops` (operator lines; inputs in0.. read operands named by `feeds`' keys) and
    run them on `feeds`; returns the outputs."""
    inputs = [
        f"pnnx.Input in{i} 0 1 {n} #{n}=({','.join(map(str, a.shape))}){_code(a)}"
        for i, (n, a) in enumerate(feeds.items())
    ]
    sess = compile_lines(tmp_path, inputs + ops, auto_batch=False)
    return sess.run(None, {f"in{i}": a for i, a in enumerate(feeds.values())})


def _code(a):
    return {"float32": "f32", "int64": "i64"}[a.dtype.name]


X = np.arange(2 * 5 * 8, dtype=np.float32).reshape(2, 5, 8)


def test_index_lists_select_as_torch_does(tmp_path):
    ids = np.array([4, 0, 2], np.int64)
    mask = [True, False, False, True, True, False, False, True]
    ops = [
        "pnnx.Expression e 1 1 ids idx expr=[None,@0]",
        "Tensor.index by_ids 2 1 x idx a $input=x $expr=idx #a=(2,3,8)f32",
        "Tensor.index by_consts 1 1 x b expr=[None,[4,0,-1]] #b=(2,3,8)f32",
        f"Tensor.index by_mask 1 1 x c expr=[None,None,[{','.join(map(str, mask))}]] #c=(2,5,4)f32",
        "Tensor.index by_none 1 1 x d expr=[None,[False,False,False,False,False]] #d=(2,0,8)f32",
        "Tensor.index by_pairs 1 1 x f expr=[[1,0],None,[3,-2]] #f=(2,5)f32",
        "pnnx.Output out 5 0 a b c d f",
    ]
    a, b, c, d, f = compile_and_run(tmp_path, ops, {"x": X, "ids": ids})
    np.testing.assert_array_equal(a, X[:, ids])
    np.testing.assert_array_equal(b, X[:, [4, 0, -1]])
    np.testing.assert_array_equal(c, X[:, :, np.array(mask)])
    assert d.shape == (2, 0, 8)
    np.testing.assert_array_equal(f, X[[1, 0], :, [3, -2]])


def test_index_put_reads_its_list(tmp_path):
    x = np.zeros((4, 5), np.float32)
    ids = np.array([3, 1], np.int64)
    v = np.arange(8, dtype=np.float32).reshape(4, 2)
    ops = [
        "pnnx.Expression e 1 1 ids idx expr=[None,@0]",
        "Tensor.index_put p 3 1 x idx v y accumulate=False $input=x $indices=idx $values=v #y=(4,5)f32",
        "pnnx.Output out 1 0 y",
    ]
    (got,) = compile_and_run(tmp_path, ops, {"x": x, "ids": ids, "v": v})
    want = x.copy()
    want[:, ids] = v
    np.testing.assert_array_equal(got, want)


def test_size_lists_feed_expand_and_arange(tmp_path):
    x = np.arange(3, dtype=np.float32).reshape(1, 3, 1)
    y = np.zeros((2, 3, 4), np.float32)
    ops = [
        "pnnx.Expression e 1 1 y s expr=[size(@0,0),-1,size(@0,-1)]",
        "Tensor.expand ex 2 1 x s z $input=x $sizes=s #z=(2,3,4)f32",
        "pnnx.Expression n 1 1 y m expr=size(@0,2)",
        "torch.arange a 1 1 m r dtype=None $end=m #r=(4)i64",
        "pnnx.Output out 2 0 z r",
    ]
    z, r = compile_and_run(tmp_path, ops, {"x": x, "y": y})
    np.testing.assert_array_equal(z, np.broadcast_to(x, (2, 3, 4)))
    np.testing.assert_array_equal(r, np.arange(4))


ERRORS = [
    # (operator lines, node named, message)
    (
        [
            "pnnx.Expression e 1 1 ids idx expr=[None,size(@0,0)]",
            "Tensor.index ix 2 1 x idx a $input=x $expr=idx #a=(2,3,8)f32",
        ],
        "Tensor.index 'ix'",
        "index entry 'size(@0,0)' in '[None,size(@0,0)]' is not supported",
    ),
    (
        ["Tensor.index ix 1 1 x a expr=[None,[1,2.5]] #a=(2,2,8)f32"],
        "Tensor.index 'ix'",
        "index list '[1,2.5]' must hold constant ints or bools",
    ),
    (
        ["Tensor.index ix 1 1 x a expr=[None,[]] #a=(2,0,8)f32"],
        "Tensor.index 'ix'",
        "index list '[]' must hold constant ints or bools",
    ),
    (
        ["Tensor.index ix 1 1 x a expr=[None,[True,False]] #a=(2,1,8)f32"],
        "Tensor.index 'ix'",
        "boolean index list '[True,False]' has 2 entries for dim 1 of size 5",
    ),
    (
        ["Tensor.index ix 1 1 x a expr=[None,[0,5]] #a=(2,2,8)f32"],
        "Tensor.index 'ix'",
        "index list '[0,5]' out of range for dim 1 of size 5",
    ),
    (
        ["Tensor.index ix 1 1 x a expr=[None,None,None,@0] #a=(2,5,8)f32"],
        "Tensor.index 'ix'",
        "uses @0 but the node has 0 inputs",
    ),
    (["Tensor.index ix 1 1 x a expr=[None,[0,1] #a=(2,2,8)f32"], "Tensor.index 'ix'", "unclosed '['"),
    (["Tensor.index ix 1 1 x a expr=5 #a=(2,5,8)f32"], "Tensor.index 'ix'", "index expression '5' is not a list"),
    (
        [
            "pnnx.Expression e 1 1 ids idx expr=[None,@0,None,None]",
            "Tensor.index ix 2 1 x idx a $input=x $expr=idx #a=(2,3,8)f32",
        ],
        "Tensor.index 'ix'",
        "index expression '[None,@0,None,None]' has more entries than the input's 3 dims",
    ),
    (
        [
            "pnnx.Expression e 1 1 ids idx expr=[None,[0,1]]",
            "Tensor.index_put p 3 1 x idx x y $input=x $indices=idx $values=x #y=(2,5,8)f32",
        ],
        "Tensor.index_put 'p'",
        "index entry '[0,1]' in '[None,[0,1]]' is not supported",
    ),
    (
        [
            "pnnx.Expression e 1 1 x s expr=[size(@0,0),int(size(@0,1)),8]",
            "Tensor.expand ex 2 1 x s z $input=x $sizes=s #z=(2,5,8)f32",
        ],
        "Tensor.expand 'ex'",
        "size list '[size(@0,0),int(size(@0,1)),8]': entry 'int(size(@0,1))' is not an int",
    ),
    (
        [
            "pnnx.Expression e 1 1 x s expr=[size(@0,0),size(@0,3),8]",
            "Tensor.expand ex 2 1 x s z $input=x $sizes=s #z=(2,5,8)f32",
        ],
        "Tensor.expand 'ex'",
        "entry 'size(@0,3)' is not an int or size(@0, dim)",
    ),
    (
        [
            "pnnx.Expression e 2 1 x ids s expr=[size(@0,0),size(@1,0),8]",
            "Tensor.expand ex 2 1 x s z $input=x $sizes=s #z=(2,5,8)f32",
        ],
        "pnnx.Expression 'e'",
        "size list '[size(@0,0),size(@1,0),8]' must read one tensor",
    ),
    (
        ["pnnx.Expression n 1 1 x m expr=size(@0,1.5)", "torch.arange a 1 1 m r dtype=None $end=m #r=(5)i64"],
        "pnnx.Expression 'n'",
        "expression 'size(@0,1.5)' feeding arange must be size(@0,dim)",
    ),
    (
        ["pnnx.Expression e 1 1 x y expr=mul(size(@0,1),2)"],
        "pnnx.Expression 'e'",
        "computes on tensor shapes (dynamic-shape export)",
    ),
    (
        ["pnnx.Expression e 1 1 x y expr=[1,2]"],
        "pnnx.Expression 'e'",
        "computes on tensor shapes (dynamic-shape export)",
    ),
    (["pnnx.Expression e 1 1 x y expr=add(@0,None)"], "pnnx.Expression 'e'", "None is no value"),
    (
        ["pnnx.Expression e 1 1 ids idx expr=[None,@0", "Tensor.index ix 2 1 x idx a $input=x $expr=idx #a=(2,3,8)f32"],
        "pnnx.Expression 'e'",
        "unclosed '['",
    ),
]


@pytest.mark.parametrize("ops,where,message", ERRORS)
def test_list_errors_name_the_node_and_the_entry(tmp_path, ops, where, message):
    t = ops[-1].split()
    last = t[3 + int(t[2]) + int(t[3])]  # the last op's last output
    with pytest.raises(PmxCompileError) as info:
        compile_and_run(tmp_path, ops + [f"pnnx.Output out 1 0 {last}"], {"x": X, "ids": np.array([4, 0, 2], np.int64)})
    assert where in str(info.value) and message in str(info.value), str(info.value)
