#!/usr/bin/env python3
"""The peers of `tensorport farm --device cuda --model MODEL.onnx --input-list LIST`: the same
files, through the same transform, into the same network, end to end (folder to scores on the
host), in the pipelines a Python user would build:

  dataloader-ort      torch DataLoader (N worker processes, torchvision.io + transforms.v2,
                      pinned batches) -> onnxruntime-gpu on the ONNX file, the batch bound on
                      the GPU with I/O binding (no host copy), the scores to the host
  dali-ort            NVIDIA DALI's mixed pipeline (hardware/nvJPEG decoding, resize and
                      normalise on the GPU) -> the same onnxruntime session, bound in place
  dataloader-compile  the DataLoader -> the same network in PyTorch (torchvision's ResNet-50,
                      seed 0: what bench/peers/resnet50_onnx.py exported) under torch.compile,
                      channels_last, the model's precision
  dali-compile        DALI -> that compiled network

The transform is the standard evaluation one (shorter side to 256, centre crop 224, ImageNet
mean and standard deviation), batches of --batch. images/s counts the images after the first
batch (compilation and warm-up excluded) until the last batch's scores are on the host.

    python3 bench/peers/onnx_pipelines.py LIST MODEL.onnx [--pipelines dataloader-ort,dali-ort]
                                         [--batch 128] [--workers 15] [--threads 15]
                                         [--hw-load 0.65,0.9]

LIST names the files, one per line (the list the farm is given). Needs torch, torchvision and
onnxruntime-gpu (the ort pipelines), nvidia-dali-cuda130 (the dali ones).
"""
import argparse
import os
import time

import torch
from torch.utils.data import DataLoader, Dataset
from torchvision.io import ImageReadMode, decode_jpeg, read_file
from torchvision.transforms import v2

MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
TRANSFORM = v2.Compose([v2.Resize(256, antialias=True), v2.CenterCrop(224),
                        v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)])


class Files(Dataset):
    def __init__(self, files):
        self.files = files

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        return TRANSFORM(decode_jpeg(read_file(self.files[i]), mode=ImageReadMode.RGB))


def one_thread(_worker):
    torch.set_num_threads(1)


def dataloader_batches(files, batch, workers):
    """Batches of normalised f32 images on the GPU."""
    dl = DataLoader(Files(files), batch_size=batch, num_workers=workers, pin_memory=True,
                    prefetch_factor=4, worker_init_fn=one_thread, persistent_workers=False)
    for x in dl:
        yield x.cuda(non_blocking=True)


def dali_batches(files, batch, threads, hw_load=0.9):
    """Batches of normalised f32 images on the GPU, from DALI's mixed pipeline (`hw_load`: the
    share of the images given to the JPEG engines)."""
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    @pipeline_def
    def transform():
        jpegs, _ = fn.readers.file(files=files, name="reader")
        images = fn.decoders.image(jpegs, device="mixed", output_type=types.RGB,
                                   hw_decoder_load=hw_load)
        images = fn.resize(images, resize_shorter=256, antialias=True,
                           interp_type=types.INTERP_LINEAR)
        return fn.crop_mirror_normalize(images, crop=(224, 224), dtype=types.FLOAT,
                                        output_layout="CHW",
                                        mean=[m * 255 for m in MEAN], std=[s * 255 for s in STD])

    pipe = transform(batch_size=batch, num_threads=threads, device_id=0, prefetch_queue_depth=3)
    pipe.build()
    it = DALIGenericIterator(pipe, ["x"], reader_name="reader",
                             last_batch_policy=LastBatchPolicy.PARTIAL)
    for b in it:
        yield b[0]["x"]


def cuda_options(settings):
    """The CUDA execution provider's options: onnxruntime's own defaults (TF32 on, exhaustive
    convolution search), or "best": those with NHWC and the largest convolution workspace."""
    o = {"device_id": 0}
    if settings == "best":
        o.update({"prefer_nhwc": 1, "cudnn_conv_use_max_workspace": 1,
                  "cudnn_conv_algo_search": "EXHAUSTIVE", "use_tf32": 1})
    return o


class Ort:
    """The ONNX file in onnxruntime-gpu, each batch bound where it lies on the GPU."""

    def __init__(self, path):
        import onnxruntime as ort
        self.ort = ort
        so = ort.SessionOptions()
        so.log_severity_level = 3
        providers = [("CUDAExecutionProvider", cuda_options(os.environ.get("ORT_SETTINGS", "best")))]
        self.s = ort.InferenceSession(path, so, providers=providers)
        self.inp, self.out = self.s.get_inputs()[0], self.s.get_outputs()[0]
        self.half = self.inp.type == "tensor(float16)"
        self.np_type = __import__("numpy").float16 if self.half else __import__("numpy").float32

    def __call__(self, x):
        x = x.half() if self.half else x.float()
        x = x.contiguous()
        b = self.s.io_binding()
        b.bind_input(self.inp.name, "cuda", 0, self.np_type, tuple(x.shape), x.data_ptr())
        b.bind_output(self.out.name, "cpu")
        # The input was written on torch's stream: ONNX Runtime runs on its own.
        torch.cuda.current_stream().synchronize()
        self.s.run_with_iobinding(b)
        return b.copy_outputs_to_cpu()[0]


class Compiled:
    """torchvision's ResNet-50 (seed 0, as exported) under torch.compile, channels_last."""

    def __init__(self, half):
        import torchvision
        torch.manual_seed(0)
        m = torchvision.models.resnet50().eval().cuda().to(memory_format=torch.channels_last)
        self.dtype = torch.float16 if half else torch.float32
        self.m = torch.compile(m.to(self.dtype))

    @torch.no_grad()
    def __call__(self, x):
        x = x.to(self.dtype).contiguous(memory_format=torch.channels_last)
        return self.m(x).float().cpu().numpy()


def rate(batches, model, n):
    """images/s after the first batch, until the last batch's scores are on the host."""
    it = iter(batches)
    first = next(it)
    model(first)
    model(first)  # a second call: compiled graphs and ONNX Runtime's plans settle
    done, t = 0, time.perf_counter()
    for x in it:
        y = model(x)
        assert y.shape[0] == x.shape[0]
        done += x.shape[0]
    dt = time.perf_counter() - t
    assert done == n - first.shape[0], (done, n)
    return done / dt


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("list")
    ap.add_argument("model")
    ap.add_argument("--pipelines", default="dataloader-ort,dali-ort,dataloader-compile,dali-compile")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--workers", type=int, default=15, help="DataLoader worker processes")
    ap.add_argument("--threads", type=int, default=15, help="DALI's CPU threads")
    ap.add_argument("--hw-load", default="0.9",
                    help="DALI's hw_decoder_load; a comma-separated list runs each DALI pipeline per value")
    a = ap.parse_args()
    files = [l.rstrip("\n") for l in open(a.list) if l.strip()]
    ort = Ort(a.model) if "ort" in a.pipelines else None
    half = ort.half if ort else a.model.endswith("_f16.onnx")
    print(f"{len(files)} files, batch {a.batch}, {a.model} ({'f16' if half else 'f32'})")
    compiled = None  # compiled once, for both sources
    runs = [(p, load) for p in a.pipelines.split(",")
            for load in (a.hw_load.split(",") if p.startswith("dali") else [None])]
    for p, load in runs:
        source, engine = p.split("-")
        batches = (dataloader_batches(files, a.batch, a.workers) if source == "dataloader"
                   else dali_batches(files, a.batch, a.threads, float(load)))
        if engine == "compile" and compiled is None:
            compiled = Compiled(half)
        model = ort if engine == "ort" else compiled
        ips = rate(batches, model, len(files))
        name = p if load is None else f"{p} (hw_decoder_load {load})"
        print(f"{name}: {ips:.0f} images/s after the first batch", flush=True)


if __name__ == "__main__":
    main()
