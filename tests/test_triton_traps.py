"""Triton traps the interpreter hides: the CPU tests run kernels interpreted, where these work,
while the GPU's compiler (Triton 3.6 on the H200) rejects them. Read with ``ast``.

- A ``@triton.jit`` helper with a string default (``CACHE: tl.constexpr = ""``): a call that
  leaves it to its default fails to compile on the GPU with "'str' object has no attribute
  'type'" (session 16: every decode step of ``decode_attention`` failed this way for one
  commit, while CI, interpreted, passed). Pass strings explicitly; give no string defaults.
"""

import ast
from pathlib import Path

import mrv2

PKG = Path(mrv2.__file__).parent


def _is_triton_jit(dec: ast.expr) -> bool:
    target = dec.func if isinstance(dec, ast.Call) else dec
    return isinstance(target, ast.Attribute) and target.attr == "jit" \
        and isinstance(target.value, ast.Name) and target.value.id == "triton"


def jit_string_defaults(source: str) -> list[str]:
    """``"function(arg)"`` for every string default of a ``@triton.jit`` function."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef) and any(map(_is_triton_jit, node.decorator_list)):
            args = node.args.args
            for arg, default in zip(args[len(args) - len(node.args.defaults):],
                                    node.args.defaults, strict=True):
                if isinstance(default, ast.Constant) and isinstance(default.value, str):
                    found.append(f"{node.name}({arg.arg})")
    return found


def test_the_check_finds_a_string_default():
    src = ("import triton\nimport triton.language as tl\n@triton.jit\n"
           "def f(x, CACHE: tl.constexpr = '', N: tl.constexpr = 4):\n    pass\n"
           "@triton.jit(do_not_specialize=['x'])\ndef g(x, S: tl.constexpr = '.cg'):\n"
           "    pass\ndef h(x, s=''):\n    pass\n")
    assert jit_string_defaults(src) == ["f(CACHE)", "g(S)"]


def test_no_jit_function_has_a_string_default():
    found = {str(p.relative_to(PKG.parent)): hits for p in sorted(PKG.rglob("*.py"))
             if (hits := jit_string_defaults(p.read_text()))}
    assert not found, f"string defaults in @triton.jit functions (pass them explicitly): {found}"
