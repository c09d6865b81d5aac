"""The JPEG decoder compiles once per process, whatever reads its file and whoever calls it.

Numba compiles a kernel once per signature, and the JPEG decoder's core (``_decode_one``) takes
about a minute of LLVM work a signature. A file's columns are read-only when mapped and writable
when a reader holds them in memory (a folder of shards); a ``prange`` index is unsigned, a
``range``'s signed: each difference used to compile the decoder again (four signatures in the
test suite). The decoders give kernels read-only columns and a signed sample index.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import numpy as np

    from stoker.dataset import ShardedWriter
    from stoker.decoders import IntDecoder, RandomResizedCropRGBImageDecoder, SimpleRGBImageDecoder
    from stoker.fields import IntField, RGBImageField
    from stoker.image import _kernels
    from stoker.loader import Loader, OrderOption
    from stoker.transforms import RandomHorizontalFlip, ToTensor
    from stoker.writer import DatasetWriter

    out = Path(sys.argv[1])
    rng = np.random.default_rng(0)
    data = [(rng.integers(0, 256, (24, 20, 3), dtype=np.uint8), i) for i in range(40)]
    fields = {"image": RGBImageField(write_mode="jpg"), "label": IntField()}
    DatasetWriter(out / "one.stoker", fields, progress=False).from_indexed_dataset(data)
    ShardedWriter(out / "shards", fields, samples_per_shard=16, num_workers=1, progress=False).from_indexed_dataset(data)
    for source in (out / "one.stoker", out / "shards"):
        for image in (
            [RandomResizedCropRGBImageDecoder((16, 16)), RandomHorizontalFlip(), ToTensor()],  # fused, per sample
            [SimpleRGBImageDecoder()],  # the batch kernel
        ):
            pipelines = {"image": image, "label": [IntDecoder(), ToTensor()]}
            with Loader(str(source), batch_size=8, num_workers=2, order=OrderOption.RANDOM, pipelines=pipelines) as loader:
                assert sum(len(b[1]) for b in loader) == 40
    print(len(_kernels._decode_one.signatures))
    """
)


def test_the_jpeg_decoder_has_one_signature_for_files_shards_fused_and_batch_kernels(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "STOKER_COMPILED_EPOCH"}  # (the compiled producer loop too)
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-1] == "1", f"the decoder compiled for {run.stdout.split()[-1]} signatures; expected 1"
