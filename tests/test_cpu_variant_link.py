"""The CPU kernel variants do not leak their instruction sets into shared code (CMakeLists.txt).

The extension holds every CPU kernel variant (DEFAULT, AVX2, AVX512, AVX512_BF16), each
compiled with its own -m flags. Inline functions they share with the rest of the module
(std::vector's constructor, c10 helpers) are emitted in every object that calls them out of
line, and the linker keeps one copy for all callers: if that copy came from an AVX-512
object, baseline code calling it stops an AVX2 CPU with SIGILL (as the fused-MoE combine
once did). This test disassembles the built module and checks that every function outside
the variants' own namespaces is free of VEX / EVEX instructions (AVX and later): the
copies kept are baseline ones (CMakeLists.txt's link order, and the explicit instantiations
in csrc/cpu/cpu_capability.cpp for the containers the variants use). TU-local clones
("[clone .constprop.0]" and the like) are private to the variant that made them and are not
checked.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from pagedkv import _C

# Namespaces whose code is compiled for (and only run on) a wider instruction set: our
# variants (pagedkv::cpu::AVX2::...) and ATen's Vectorized (at::vec::AVX2::...).
VARIANT_NAMESPACE = re.compile(r"::(AVX2|AVX512|AVX512_BF16)::")
# The first byte of an AVX or later instruction: VEX (c4, c5) or EVEX (62); in 64-bit mode
# those bytes start no other instruction.
WIDE_PREFIXES = ("c4", "c5", "62")


def functions_with_wide_instructions(disassembly: str) -> dict[str, int]:
    """Functions outside the variant namespaces, with how many VEX / EVEX instructions each holds."""
    found: dict[str, int] = {}
    function = None
    for line in disassembly.splitlines():
        header = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if header:
            function = header.group(1)
            continue
        fields = line.split("\t")
        if function is None or len(fields) < 3 or not fields[0].strip().endswith(":"):
            continue
        first_byte = fields[1].split()[:1]
        if (first_byte and first_byte[0] in WIDE_PREFIXES and "[clone ." not in function
                and not VARIANT_NAMESPACE.search(function)):
            found[function] = found.get(function, 0) + 1
    return found


def test_parser_flags_a_shared_function_with_avx_code():
    """The check itself: a VEX instruction in std:: code is found, one in a variant's namespace is not."""
    disassembly = "\n".join([
        "0000000000109e90 <std::vector<float, std::allocator<float> >::vector(unsigned long)>:",
        "  109e90:\t62 f2 fd 08 7c c0    \tvpbroadcastq %rax,%xmm0",
        "  109e96:\t48 89 c3             \tmov    %rax,%rbx",
        "0000000000109f00 <pagedkv::cpu::AVX2::(anonymous namespace)::load_chunk(float const*)>:",
        "  109f00:\tc5 fc 10 07          \tvmovups (%rdi),%ymm0",
        "0000000000109f40 <std::fill(float*, float*) [clone .constprop.0]>:",
        "  109f40:\tc5 fc 11 07          \tvmovups %ymm0,(%rdi)",
    ])
    assert functions_with_wide_instructions(disassembly) == {
        "std::vector<float, std::allocator<float> >::vector(unsigned long)": 1}


@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs binutils' objdump")
def test_shared_code_in_the_module_is_baseline():
    result = subprocess.run(["objdump", "-d", "-C", "-j", ".text", _C.__file__], capture_output=True, text=True,
                            check=True)
    leaked = functions_with_wide_instructions(result.stdout)
    assert not leaked, ("shared functions kept from a wider variant's object (link the variants after the "
                        f"baseline objects, CMakeLists.txt): {sorted(leaked)[:10]}")
