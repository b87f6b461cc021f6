"""The layout of runtime/kernels/ (see its __init__.py and docs/design.md): the registry
and the bind context in modules of their own, the family files importing them by their
full path and never the package namespace (no import cycle through __init__), and no
kernel reading thread-local state: factories get the binding's BindContext and keep
what they need from it."""

import ast
import inspect
import pathlib
import subprocess
import sys
import textwrap

import numpy as np

import pmx.runtime.kernels

KERNELS = pathlib.Path(pmx.runtime.kernels.__file__).resolve().parent
PACKAGE = "pmx.runtime.kernels"
# modules of the package that are not kernel families
INFRASTRUCTURE = {"__init__", "registry", "bind", "common", "attr_specs"}


def _modules():
    return {p.stem: ast.parse(p.read_text(), str(p)) for p in sorted(KERNELS.glob("*.py"))}


def _imported(tree):
    """(module, names) of every import in `tree`: `import a.b` as ("a.b", ()), `from a
    import b, c` as ("a", ("b", "c")); relative imports keep their dots."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append(("." * node.level + (node.module or ""), tuple(a.name for a in node.names)))
    return found


def _families(modules):
    """The family modules: those that register ops (a call of `register`)."""
    return {
        name
        for name, tree in modules.items()
        if any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == "register" for n in ast.walk(tree))
    }


def _fresh_process_output(code):
    """stdout of `code` run by this Python in a process of its own (no family imported)."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_registry_lists_every_family_and_only_families():
    """A lookup imports the families registry.FAMILIES lists: a family missing there
    would leave its ops unknown."""
    from pmx.runtime.kernels.registry import FAMILIES

    modules = _modules()
    assert _families(modules) == set(modules) - INFRASTRUCTURE
    assert sorted(FAMILIES) == sorted(_families(modules))


def test_families_are_imported_as_lookups_need_them():
    """`import pmx.runtime` imports no family; a lookup imports families up to the op's
    own; an op of the last family is found; an unknown op is refused with the count of
    every op. In a fresh process, so no other test has imported the families."""
    out = _fresh_process_output("""
        import sys
        import pmx.runtime
        from pmx.runtime.kernels import registry
        loaded = lambda: [f for f in registry.FAMILIES if "pmx.runtime.kernels." + f in sys.modules]
        print(loaded())
        registry.get("conv")
        print(loaded())
        print(registry.get("unfold").op, len(loaded()) == len(registry.FAMILIES))
        try:
            registry.get("no_such_op")
        except pmx.runtime.PmxFormatError as e:
            print(str(e).endswith(f"knows {len(registry.all_kernels())} ops)"))
    """)
    assert out.split("\n")[:4] == ["[]", "['conv']", "unfold True", "True"]


def test_first_lookups_from_several_threads_at_once_find_their_ops():
    """Sessions loading in several threads at once look ops up while families are still
    being imported: each lookup waits for the family it needs (Python's import lock)
    and finds its op. In a fresh process, eight threads released together, ops from
    the first, middle and last families."""
    out = _fresh_process_output("""
        import threading
        from pmx.runtime.kernels import registry
        ops = ["unfold", "stft", "lstm", "topk", "attention", "resize", "layer_norm", "conv"]
        barrier, found, errors = threading.Barrier(len(ops)), {}, []
        def look(op):
            barrier.wait()
            try:
                found[op] = registry.get(op).op
            except BaseException as e:
                errors.append(repr(e))
        threads = [threading.Thread(target=look, args=(op,)) for op in ops]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(errors == [] and all(found[op] == op for op in ops))
    """)
    assert out.split() == ["True"]


def test_no_module_of_the_package_imports_its_namespace():
    """`from pmx.runtime.kernels import register` in a family made the package and its
    families import each other; every module imports the modules it uses by full path."""
    for name, tree in _modules().items():
        if name == "__init__":
            continue
        for module, names in _imported(tree):
            assert module != PACKAGE and not module.startswith("."), f"{name}.py: from {module} import {names}"


def test_the_registry_and_the_bind_context_import_no_family():
    modules = _modules()
    families = {f"{PACKAGE}.{f}" for f in _families(modules)}
    for name in ("registry", "bind"):
        for module, names in _imported(modules[name]):
            assert module not in families, f"{name}.py imports {module}"
            assert not (module == PACKAGE and set(names) & _families(modules)), f"{name}.py imports {names}"


def test_no_kernel_module_keeps_thread_local_state():
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr == "local":
                assert not (isinstance(node.value, ast.Name) and node.value.id == "threading"), name
            if isinstance(node, ast.ImportFrom) and node.module == "threading":
                assert "local" not in {a.name for a in node.names}, name


def test_factories_and_scratch_rules_take_the_bind_context():
    """One convention for every op: make(node, inputs, outputs, ctx) and
    scratch(node, inputs, outputs, ctx)."""
    from pmx.runtime.kernels.registry import all_kernels

    for op, k in all_kernels().items():
        for rule in (k.make, k.scratch):
            if rule is not None:
                assert list(inspect.signature(rule).parameters) == ["node", "inputs", "outputs", "ctx"], op


def test_a_split_kernel_keeps_the_pool_it_was_made_with():
    """The callable holds the binding's pool, taken from ctx at make time: no lookup of
    the calling thread's state when it runs."""
    from helpers import KernelNode, bind_context, kernel_pool

    from pmx.runtime import parallel
    from pmx.runtime.kernels.registry import get

    pool = kernel_pool(2)
    x = np.ones((4, parallel.SPLIT_MIN_ELEMENTS), np.float32)
    out = np.empty_like(x)
    node = KernelNode("elementwise", {}, "mul(@0,2)", "numpy")
    run = get("elementwise").make(node, [x], [out], bind_context(pool))
    assert isinstance(run, parallel._Chooser) and run.pool is pool
    run()
    np.testing.assert_array_equal(out, 2 * x)
