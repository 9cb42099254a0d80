import pytest

try:
    import mas_kernels as mk
except ImportError:  # not built: every kernel test skips, saying why
    mk = None

# Every instruction-set path this CPU has (all of them, each skipped, where nothing is built).
ISAS = ["avx512", "avx2", "scalar"] if mk is None else [
    name for name in ("avx512", "avx2", "scalar") if mk.has_isa(name)]


@pytest.fixture(params=ISAS)
def isa(request):
    """A kernel test runs once per instruction-set path of this CPU."""
    if mk is None:
        pytest.skip("mas_kernels is not built (pip install --no-build-isolation ./native)")
    before = mk.isa()
    mk.set_isa(request.param)
    yield request.param
    mk.set_isa(before)
