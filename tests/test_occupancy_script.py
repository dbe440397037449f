"""``scripts/occupancy_sm90.py``'s occupancy arithmetic against sm_90 figures worked by hand
(the compile half needs Triton 3.6's wheel and runs on a developer's machine, not here)."""

from script_loader import load_script


def _occupancy(monkeypatch):
    # NOTE: the script sets TRITON_INTERPRET=0 for itself; monkeypatch puts it back.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return load_script("occupancy_sm90").programs_per_sm


def test_programs_an_sm_holds(monkeypatch):
    programs_per_sm = _occupancy(monkeypatch)
    # 87 registers x 4 warps: 11 x 256 a warp -> 23 warps of 65,536 registers -> 5 programs
    assert programs_per_sm(87, 4, 38 * 1024) == {"programs_per_sm": 5, "bound_by": "registers"}
    # 242 registers x 2 warps (paged attention at batch 256): 31 x 256 a warp -> 8 warps -> 4
    assert programs_per_sm(242, 2, 38 * 1024)["programs_per_sm"] == 4
    # 100 KB of shared memory (+1 KB reserved): two fit in 228 KB, whatever the registers
    assert programs_per_sm(32, 4, 100 * 1024) == {"programs_per_sm": 2,
                                                  "bound_by": "shared memory"}
    # 16 warps of few registers: 64 warps an SM -> 4; 1 warp: the 32-block cap
    assert programs_per_sm(24, 16, 0) == {"programs_per_sm": 4, "bound_by": "warps"}
    assert programs_per_sm(16, 1, 0) == {"programs_per_sm": 32, "bound_by": "blocks"}
    # 255 registers x 8 warps: 8,192 a warp -> 8 warps -> exactly one program
    assert programs_per_sm(255, 8, 0)["programs_per_sm"] == 1


def test_registers_a_program_and_fitting_beside(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    occ = load_script("occupancy_sm90")
    # 127 registers round up to 128 a thread (4,096 a warp): 16 warps take all 65,536
    assert occ.regs_per_program(127, 16) == 65536
    assert occ.regs_per_program(104, 8) == 26624          # 104 -> 3,328 a warp (13 x 256)
    whole = {"regs_per_program": 65536, "shared_bytes": 41 * 1024, "num_warps": 16}
    o_proj = {"regs_per_program": 26624, "shared_bytes": 4096, "num_warps": 8}
    down = {"regs_per_program": 34816, "shared_bytes": 4096, "num_warps": 8}
    assert not occ.fits_beside(whole, o_proj)             # no register left beside it
    assert occ.fits_beside(o_proj, down)                  # 61,440 of 65,536
    big_smem = {**o_proj, "shared_bytes": 120 * 1024}
    assert not occ.fits_beside(big_smem, {**down, "shared_bytes": 110 * 1024})
    assert not occ.fits_beside({**o_proj, "num_warps": 40}, {**down, "num_warps": 32})
