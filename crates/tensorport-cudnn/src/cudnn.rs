//! cuDNN, loaded at run time like libcuda: a handle bound to one of our streams and the
//! descriptors a forward convolution needs, each owning its cuDNN object. Every `unsafe` call
//! into cuDNN lives here; [`crate::ConvNet`] builds on these.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cudnn::sys;

use crate::{Error, Result};
use tensorport_cuda::{Gpu, Stream};

pub(crate) use sys::cudnnConvolutionFwdAlgo_t as Algo;
pub(crate) use sys::cudnnDataType_t as DataType;
pub(crate) use sys::cudnnMathType_t as MathType;
pub(crate) use sys::cudnnTensorFormat_t as Format;

/// `status` as this crate's error, naming the call.
pub(crate) fn check(call: &'static str, status: sys::cudnnStatus_t) -> Result<()> {
    match status {
        sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS => Ok(()),
        s => Err(Error::Cudnn {
            call,
            status: format!("{s:?}"),
        }),
    }
}

/// Whether libcudnn can be loaded, with the reason when not.
pub(crate) fn available() -> Result<()> {
    // SAFETY: only tries to dlopen the library.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::NoCudnn(
            "libcudnn.so.9 could not be loaded: install cuDNN 9 (`pip install nvidia-cudnn-cu13`, \
             or NVIDIA's cudnn9 package) and put its lib folder on LD_LIBRARY_PATH \
             (dist/gpu/gpu-env.sh does for pip's)"
                .into(),
        ))
    }
}

/// The version of the loaded cuDNN (e.g. 91400 for 9.14.0).
pub(crate) fn version() -> usize {
    // SAFETY: the library was found by `available` (callers check first); no arguments.
    unsafe { sys::cudnnGetVersion() }
}

/// A cuDNN handle whose work is enqueued on one stream; destroyed on drop.
pub(crate) struct Handle {
    gpu: Arc<Gpu>,
    raw: sys::cudnnHandle_t,
}

// SAFETY: a cuDNN handle may be used from any thread, one call at a time; `Handle` is only
// used through `&mut` or by its single owner (`ConvNet`), which is not `Sync`.
unsafe impl Send for Handle {}

impl Handle {
    /// A handle on `gpu` whose work goes to `stream` (which must outlive it).
    pub(crate) fn new(gpu: &Arc<Gpu>, stream: &Stream) -> Result<Handle> {
        available()?;
        gpu.bind()?;
        let mut raw: sys::cudnnHandle_t = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer; the device's primary context is current.
        check("cudnnCreate", unsafe { sys::cudnnCreate(&mut raw) })?;
        let h = Handle {
            gpu: gpu.clone(),
            raw,
        };
        // SAFETY: a live handle and a live stream of the same context.
        check("cudnnSetStream", unsafe {
            sys::cudnnSetStream(h.raw, stream.raw().cast())
        })?;
        Ok(h)
    }

    /// The raw handle, for the graph API's calls (`cudnn_graph`).
    pub(crate) fn raw(&self) -> sys::cudnnHandle_t {
        self.raw
    }

    /// The fastest algorithms for `conv`, measured by cuDNN on this device (it allocates what
    /// it needs), best first, only those that ran.
    pub(crate) fn find_algorithms(
        &self,
        x: &TensorDesc,
        w: &FilterDesc,
        conv: &ConvDesc,
        y: &TensorDesc,
    ) -> Result<Vec<(Algo, MathType, usize)>> {
        self.gpu.bind()?;
        const N: usize = 8;
        // SAFETY: plain-old-data structs; cuDNN writes `returned` of them.
        let mut perf: [sys::cudnnConvolutionFwdAlgoPerf_t; N] = unsafe { std::mem::zeroed() };
        let mut returned = 0;
        // SAFETY: live handle and descriptors; `perf` holds N results.
        check("cudnnFindConvolutionForwardAlgorithm", unsafe {
            sys::cudnnFindConvolutionForwardAlgorithm(
                self.raw,
                x.raw,
                w.raw,
                conv.raw,
                y.raw,
                N as i32,
                &mut returned,
                perf.as_mut_ptr(),
            )
        })?;
        Ok(perf[..(returned.max(0) as usize).min(N)]
            .iter()
            .filter(|p| p.status == sys::cudnnStatus_t::CUDNN_STATUS_SUCCESS)
            .map(|p| (p.algo, p.mathType, p.memory))
            .collect())
    }

    /// Workspace bytes `algo` needs for `conv` on these shapes.
    pub(crate) fn workspace_size(
        &self,
        x: &TensorDesc,
        w: &FilterDesc,
        conv: &ConvDesc,
        y: &TensorDesc,
        algo: Algo,
    ) -> Result<usize> {
        self.gpu.bind()?;
        let mut n = 0usize;
        // SAFETY: live handle and descriptors, a valid out-pointer.
        check("cudnnGetConvolutionForwardWorkspaceSize", unsafe {
            sys::cudnnGetConvolutionForwardWorkspaceSize(
                self.raw, x.raw, w.raw, conv.raw, y.raw, algo, &mut n,
            )
        })?;
        Ok(n)
    }

    /// Enqueues `y = conv(x, w)` on the handle's stream.
    ///
    /// # Safety
    /// `x`, `w` and `y` must be device memory of this context laid out as their descriptors
    /// say, `workspace` at least `workspace_len` bytes (as [`Handle::workspace_size`] asked for
    /// `algo`), all valid until the stream has run the convolution; `y` must not overlap the
    /// others.
    pub(crate) unsafe fn forward(
        &self,
        (xd, x): (&TensorDesc, u64),
        (wd, w): (&FilterDesc, u64),
        conv: &ConvDesc,
        algo: Algo,
        (workspace, workspace_len): (u64, usize),
        (yd, y): (&TensorDesc, u64),
    ) -> Result<()> {
        self.gpu.bind()?;
        // Scaling factors are floats for every data type but double.
        let (one, zero) = (1f32, 0f32);
        // SAFETY: the caller's contract; the descriptors are live.
        check("cudnnConvolutionForward", unsafe {
            sys::cudnnConvolutionForward(
                self.raw,
                (&one as *const f32).cast(),
                xd.raw,
                x as *const c_void,
                wd.raw,
                w as *const c_void,
                conv.raw,
                algo,
                workspace as *mut c_void,
                workspace_len,
                (&zero as *const f32).cast(),
                yd.raw,
                y as *mut c_void,
            )
        })
    }

    /// Enqueues `y = relu(conv(x, w) + z + bias)` (with `z`) or `relu(conv(x, w) + bias)` on
    /// the handle's stream, in one cuDNN call.
    ///
    /// # Safety
    /// As [`Handle::forward`]; `z`, when given, must be device memory laid out as `y`, and
    /// `bias` hold one value of `y`'s type per output channel.
    pub(crate) unsafe fn forward_bias_relu(
        &self,
        (xd, x): (&TensorDesc, u64),
        (wd, w): (&FilterDesc, u64),
        (conv, algo): (&ConvDesc, Algo),
        (workspace, workspace_len): (u64, usize),
        (z, (bd, bias), relu): (Option<u64>, (&TensorDesc, u64), &Relu),
        (yd, y): (&TensorDesc, u64),
    ) -> Result<()> {
        self.gpu.bind()?;
        // Without a residual, z is y scaled by 0 (cuDNN allows z to be y).
        let (one, alpha2) = (1f32, if z.is_some() { 1f32 } else { 0f32 });
        // SAFETY: the caller's contract; the descriptors are live.
        check("cudnnConvolutionBiasActivationForward", unsafe {
            sys::cudnnConvolutionBiasActivationForward(
                self.raw,
                (&one as *const f32).cast(),
                xd.raw,
                x as *const c_void,
                wd.raw,
                w as *const c_void,
                conv.raw,
                algo,
                workspace as *mut c_void,
                workspace_len,
                (&alpha2 as *const f32).cast(),
                yd.raw,
                z.unwrap_or(y) as *const c_void,
                bd.raw,
                bias as *const c_void,
                relu.raw,
                yd.raw,
                y as *mut c_void,
            )
        })
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        // SAFETY: created in `new`, destroyed once; owners synchronise the stream first.
        let _ = unsafe { sys::cudnnDestroy(self.raw) };
    }
}

/// A descriptor type owning one cuDNN descriptor: made by `create`, released on drop by
/// `destroy`.
macro_rules! descriptor {
    ($(#[$doc:meta])* $name:ident, $raw:ty, $create:ident, $destroy:ident) => {
        $(#[$doc])*
        pub(crate) struct $name {
            raw: $raw,
        }

        // SAFETY: a descriptor is plain host memory owned by this value alone.
        unsafe impl Send for $name {}

        impl $name {
            /// A descriptor, not yet set.
            fn create() -> Result<$name> {
                available()?;
                let mut raw: $raw = std::ptr::null_mut();
                // SAFETY: a valid out-pointer.
                check(stringify!($create), unsafe { sys::$create(&mut raw) })?;
                Ok($name { raw })
            }
        }

        impl Drop for $name {
            fn drop(&mut self) {
                // SAFETY: made by `create`, destroyed once.
                let _ = unsafe { sys::$destroy(self.raw) };
            }
        }
    };
}

descriptor!(
    /// A 4-d tensor descriptor, NCHW or NHWC.
    TensorDesc,
    sys::cudnnTensorDescriptor_t,
    cudnnCreateTensorDescriptor,
    cudnnDestroyTensorDescriptor
);
descriptor!(
    /// A filter descriptor: `[K, C, R, S]` memory for NCHW, `[K, R, S, C]` for NHWC.
    FilterDesc,
    sys::cudnnFilterDescriptor_t,
    cudnnCreateFilterDescriptor,
    cudnnDestroyFilterDescriptor
);
descriptor!(
    /// A 2-d cross-correlation (what deep-learning frameworks call convolution).
    ConvDesc,
    sys::cudnnConvolutionDescriptor_t,
    cudnnCreateConvolutionDescriptor,
    cudnnDestroyConvolutionDescriptor
);
descriptor!(
    /// A ReLU activation descriptor.
    Relu,
    sys::cudnnActivationDescriptor_t,
    cudnnCreateActivationDescriptor,
    cudnnDestroyActivationDescriptor
);

impl TensorDesc {
    /// Dimensions are given as `[N, C, H, W]` whatever the `format` of the memory.
    pub(crate) fn new(
        dtype: DataType,
        format: Format,
        [n, c, h, w]: [usize; 4],
    ) -> Result<TensorDesc> {
        let d = TensorDesc::create()?;
        let [n, c, h, w] = dims([n, c, h, w])?;
        // SAFETY: a live descriptor.
        check("cudnnSetTensor4dDescriptor", unsafe {
            sys::cudnnSetTensor4dDescriptor(d.raw, format, dtype, n, c, h, w)
        })?;
        Ok(d)
    }
}

impl FilterDesc {
    /// Dimensions are given as `[K, C, R, S]` whatever the `format` of the memory.
    pub(crate) fn new(
        dtype: DataType,
        format: Format,
        [k, c, r, s]: [usize; 4],
    ) -> Result<FilterDesc> {
        let d = FilterDesc::create()?;
        let [k, c, r, s] = dims([k, c, r, s])?;
        // SAFETY: a live descriptor.
        check("cudnnSetFilter4dDescriptor", unsafe {
            sys::cudnnSetFilter4dDescriptor(d.raw, dtype, format, k, c, r, s)
        })?;
        Ok(d)
    }
}

impl ConvDesc {
    /// Square padding and stride, no dilation, accumulating in `compute` with `math`.
    pub(crate) fn new(
        pad: usize,
        stride: usize,
        compute: DataType,
        math: MathType,
    ) -> Result<ConvDesc> {
        let d = ConvDesc::create()?;
        let (p, s) = (dim(pad)?, dim(stride)?);
        // SAFETY: a live descriptor.
        check("cudnnSetConvolution2dDescriptor", unsafe {
            sys::cudnnSetConvolution2dDescriptor(
                d.raw,
                p,
                p,
                s,
                s,
                1,
                1,
                sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION,
                compute,
            )
        })?;
        // SAFETY: a live descriptor.
        check("cudnnSetConvolutionMathType", unsafe {
            sys::cudnnSetConvolutionMathType(d.raw, math)
        })?;
        Ok(d)
    }
}

impl Relu {
    pub(crate) fn new() -> Result<Relu> {
        let d = Relu::create()?;
        // SAFETY: a live descriptor.
        check("cudnnSetActivationDescriptor", unsafe {
            sys::cudnnSetActivationDescriptor(
                d.raw,
                sys::cudnnActivationMode_t::CUDNN_ACTIVATION_RELU,
                sys::cudnnNanPropagation_t::CUDNN_NOT_PROPAGATE_NAN,
                0.0,
            )
        })?;
        Ok(d)
    }
}

/// Four dimensions as cuDNN's `int`s.
fn dims(d: [usize; 4]) -> Result<[i32; 4]> {
    Ok([dim(d[0])?, dim(d[1])?, dim(d[2])?, dim(d[3])?])
}

/// A dimension as cuDNN's `int`.
fn dim(n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| Error::Cudnn {
        call: "a descriptor",
        status: format!("dimension {n} does not fit cuDNN's int"),
    })
}
