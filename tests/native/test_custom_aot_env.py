"""prefetchd's compute-fence kernel and the user's own AOT kernels (MS_CUSTOM_AOT_WHITE_LIST).

MindSpore checks an AOT library against MS_CUSTOM_AOT_WHITE_LIST (one directory) each
time it builds the kernel for a new shape. prefetchd used to set the variable to its own
directory, after which every AOT kernel of the user's outside it was refused, and to append
to a value the user set, which MindSpore reads as one path, refusing both. Each case runs
in a child process with its own environment; the user's kernel is built with g++ (which
building prefetchd needs anyway).
"""
import os
import subprocess
import sys
import textwrap

import pytest

KERNEL = r"""
#include <cstdint>
extern "C" int AddOne(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                      void *stream, void *extra) {
  float *in = static_cast<float *>(params[0]); float *out = static_cast<float *>(params[1]);
  int64_t n = 1; for (int i = 0; i < ndims[0]; i++) n *= shapes[0][i];
  for (int64_t i = 0; i < n; i++) out[i] = in[i] + 1.0f;
  return 0;
}
"""

CHILD = textwrap.dedent("""
    import os, sys, tempfile, numpy as np, mindspore as ms, prefetchd
    ms.set_device("CPU")
    before = os.environ.get("MS_CUSTOM_AOT_WHITE_LIST")
    with prefetchd.Daemon(device_budget="16MiB", store_dir=tempfile.mkdtemp()) as d:
        marker = d.compute_session().marker is not None
        op = ms.ops.Custom(sys.argv[1] + ":AddOne", out_shape=lambda s: s, out_dtype=lambda t: t, func_type="aot")
        value = float(op(ms.Tensor(np.ones(4, np.float32))).asnumpy()[0])
        print("marker", marker, "user", value, "unchanged", os.environ.get("MS_CUSTOM_AOT_WHITE_LIST") == before)
""")


@pytest.fixture(scope="module")
def user_kernel(tmp_path_factory):
    where = tmp_path_factory.mktemp("user_kernels")
    (where / "add_one.cc").write_text(KERNEL)
    subprocess.run(["g++", "-O2", "-shared", "-fPIC", str(where / "add_one.cc"), "-o", str(where / "add_one.so")],
                   check=True)
    return where


@pytest.mark.parametrize("white_list", ["unset", "user_dir", "common_parent"])
def test_the_users_aot_kernels_keep_working_beside_the_compute_fence(user_kernel, white_list):
    env = {k: v for k, v in os.environ.items() if k != "MS_CUSTOM_AOT_WHITE_LIST"}
    env["GLOG_v"] = "3"
    if white_list == "user_dir":
        env["MS_CUSTOM_AOT_WHITE_LIST"] = str(user_kernel)
    elif white_list == "common_parent":
        env["MS_CUSTOM_AOT_WHITE_LIST"] = "/"
    run = subprocess.run([sys.executable, "-c", CHILD, str(user_kernel / "add_one.so")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    # A white list that leaves prefetchd's kernel out: whole-queue fences, and a log saying why.
    marker = white_list != "user_dir"
    assert run.stdout.splitlines()[-1] == f"marker {marker} user 2.0 unchanged True", run.stdout
    if not marker:
        assert "MS_CUSTOM_AOT_WHITE_LIST" in run.stderr and "using whole-queue fences" in run.stderr
