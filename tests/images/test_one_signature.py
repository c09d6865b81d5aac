"""The JPEG decoder and the resize kernel compile once per process, whatever reads the file and whoever calls them.

Numba compiles a kernel once per signature, and the JPEG decoder's core (``_decode_one``) takes
about a minute of LLVM work a signature. A file's columns are read-only when mapped and writable
when a reader holds them in memory (a folder of shards); a ``prange`` index is unsigned, a
``range``'s signed: each difference used to compile the decoder again (four signatures in the
test suite). The decoders give kernels read-only columns and a signed sample index.

The resize kernel (``stoker.image._resize.resize``) is called by the decoder's raw and JPEG paths,
by the ``RandomResizedCrop`` operation and by ``stoker.io``; read-only or writable sources and
unsigned, signed or literal sizes gave it four signatures in the suite. Its callers pass a writable
source and int64 sizes.
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
    from PIL import Image

    from stoker.dataset import ShardedWriter
    from stoker.decoders import IntDecoder, RandomResizedCropRGBImageDecoder, SimpleRGBImageDecoder
    from stoker.fields import IntField, RGBImageField
    from stoker.image import _kernels
    from stoker.loader import Loader, OrderOption
    from stoker.image import _resize
    from stoker.transforms import RandomHorizontalFlip, RandomResizedCrop, ToTensor
    import stoker.io
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
    crop = {"image": [SimpleRGBImageDecoder(), RandomResizedCrop((0.3, 1.0), (0.75, 1.33), 8)], "label": None}  # the operation's kernel
    with Loader(str(out / "one.stoker"), batch_size=8, num_workers=2, pipelines=crop) as loader:
        assert sum(len(b[0]) for b in loader) == 40
    frame = data[0][0]
    Image.fromarray(frame).save(out / "frame.jpg", quality=90)  # stoker.io: a JPEG decoded with a crop, an image resized
    blob = (out / "frame.jpg").read_bytes()
    assert stoker.io.decode_image(blob, size=(10, 12)).shape == (10, 12, 3)
    assert stoker.io.resize(frame, (7, 9)).shape == (7, 9, 3)
    print(len(_kernels._decode_one.signatures), len(_resize.resize.signatures))
    """
)


def test_the_jpeg_decoder_and_resize_have_one_signature_for_files_shards_fused_batch_and_io_kernels(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "STOKER_COMPILED_EPOCH"}  # (the compiled producer loop too)
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    decoder, resize = run.stdout.split()[-2:]
    assert decoder == "1", f"the decoder compiled for {decoder} signatures; expected 1"
    assert resize == "1", f"the resize kernel compiled for {resize} signatures; expected 1"
