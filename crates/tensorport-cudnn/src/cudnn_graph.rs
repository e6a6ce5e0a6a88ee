//! cuDNN's graph (backend) API for one forward convolution at one exact shape: the engine
//! configurations cuDNN's heuristics offer, each finalized into an execution plan that can run
//! it. The legacy API's algorithm search offers only some of cuDNN's kernels (for 16-bit
//! NHWC convolutions with few channels, not its fastest); the graph API offers them all.
//! Every `unsafe` call into the backend API lives here; [`crate::ConvNet`] times the plans.

use std::ffi::c_void;

use cudarc::cudnn::sys;

use crate::cudnn::{check, DataType, Handle};
use crate::Result;

use sys::cudnnBackendAttributeName_t as Attr;
use sys::cudnnBackendAttributeType_t as Ty;
use sys::cudnnBackendDescriptorType_t as Kind;

/// Engine configurations tried per convolution, at most (cuDNN's heuristics order them).
const MAX_CANDIDATES: usize = 8;
/// A plan needing more workspace than this is passed over.
const MAX_WORKSPACE: i64 = 256 << 20;

/// The tensors' identifiers in a plan's variant pack.
const UID_X: i64 = 1;
const UID_W: i64 = 2;
const UID_Y: i64 = 3;

/// One backend descriptor, destroyed on drop.
struct Desc(sys::cudnnBackendDescriptor_t);

impl Desc {
    fn new(kind: Kind) -> Result<Desc> {
        let mut raw: sys::cudnnBackendDescriptor_t = std::ptr::null_mut();
        // SAFETY: `raw` is a valid out-pointer.
        check("cudnnBackendCreateDescriptor", unsafe {
            sys::cudnnBackendCreateDescriptor(kind, &mut raw)
        })?;
        Ok(Desc(raw))
    }

    /// Sets attribute `name` to `values`.
    ///
    /// # Safety
    /// `V` must be the C type cuDNN reads for `ty` (e.g. `i64` for `CUDNN_TYPE_INT64`).
    unsafe fn set<V>(&self, name: Attr, ty: Ty, values: &[V]) -> Result<()> {
        // SAFETY: a live descriptor; `values` holds `len` elements of the caller's type.
        check("cudnnBackendSetAttribute", unsafe {
            sys::cudnnBackendSetAttribute(
                self.0,
                name,
                ty,
                values.len() as i64,
                values.as_ptr().cast::<c_void>(),
            )
        })
    }

    fn set_i64(&self, name: Attr, values: &[i64]) -> Result<()> {
        // SAFETY: i64 is CUDNN_TYPE_INT64's C type.
        unsafe { self.set(name, Ty::CUDNN_TYPE_INT64, values) }
    }

    fn set_descs(&self, name: Attr, descs: &[&Desc]) -> Result<()> {
        let raw: Vec<sys::cudnnBackendDescriptor_t> = descs.iter().map(|d| d.0).collect();
        // SAFETY: descriptors are CUDNN_TYPE_BACKEND_DESCRIPTOR's C type; each is live.
        unsafe { self.set(name, Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR, &raw) }
    }

    fn set_handle(&self, name: Attr, handle: &Handle) -> Result<()> {
        // SAFETY: a cuDNN handle is CUDNN_TYPE_HANDLE's C type; live while `handle` is.
        unsafe { self.set(name, Ty::CUDNN_TYPE_HANDLE, &[handle.raw()]) }
    }

    fn finalize(self) -> Result<Desc> {
        // SAFETY: a live descriptor.
        check("cudnnBackendFinalize", unsafe {
            sys::cudnnBackendFinalize(self.0)
        })?;
        Ok(self)
    }

    fn get_i64(&self, name: Attr) -> Result<i64> {
        let (mut v, mut n) = (0i64, 0i64);
        // SAFETY: one i64 out of a finalized descriptor.
        check("cudnnBackendGetAttribute", unsafe {
            sys::cudnnBackendGetAttribute(
                self.0,
                name,
                Ty::CUDNN_TYPE_INT64,
                1,
                &mut n,
                (&mut v as *mut i64).cast(),
            )
        })?;
        Ok(v)
    }
}

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        let _ = unsafe { sys::cudnnBackendDestroyDescriptor(self.0) };
    }
}

/// A 4-d tensor's dimensions in NCHW order and its strides, in the layout given.
fn strides(dims: [i64; 4], nhwc: bool) -> [i64; 4] {
    let [_, c, h, w] = dims;
    if nhwc {
        [h * w * c, 1, w * c, c]
    } else {
        [c * h * w, h * w, w, 1]
    }
}

fn tensor(uid: i64, dtype: DataType, dims: [i64; 4], nhwc: bool) -> Result<Desc> {
    let t = Desc::new(Kind::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
    // SAFETY: the data type enum is CUDNN_TYPE_DATA_TYPE's C type.
    unsafe {
        t.set(
            Attr::CUDNN_ATTR_TENSOR_DATA_TYPE,
            Ty::CUDNN_TYPE_DATA_TYPE,
            &[dtype],
        )?
    };
    t.set_i64(Attr::CUDNN_ATTR_TENSOR_DIMENSIONS, &dims)?;
    t.set_i64(Attr::CUDNN_ATTR_TENSOR_STRIDES, &strides(dims, nhwc))?;
    t.set_i64(Attr::CUDNN_ATTR_TENSOR_UNIQUE_ID, &[uid])?;
    t.set_i64(Attr::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, &[16])?;
    t.finalize()
}

/// The shape of one convolution: `[N, C, H, W]` in, `[K, C, R, R]` weights, `[N, K, P, Q]`
/// out, square stride and padding, in one data type and layout.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ConvShape {
    pub x: [usize; 4],
    pub w: [usize; 4],
    pub y: [usize; 4],
    pub stride: usize,
    pub padding: usize,
    pub dtype: DataType,
    pub nhwc: bool,
}

fn dims(d: [usize; 4]) -> [i64; 4] {
    d.map(|v| v as i64)
}

/// An execution plan for one [`ConvShape`].
pub(crate) struct GraphConv {
    plan: Desc,
    workspace: usize,
}

// SAFETY: a finalized plan is read-only data of cuDNN's, usable from any thread with a handle
// of its device; `ConvNet`, its only owner, is not `Sync`.
unsafe impl Send for GraphConv {}

impl std::fmt::Debug for GraphConv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GraphConv")
            .field("workspace", &self.workspace)
            .finish_non_exhaustive()
    }
}

impl GraphConv {
    /// The plans cuDNN's heuristics offer for `shape` that finalize on this device, in the
    /// heuristics' order (best guess first), at most [`MAX_CANDIDATES`]; empty where none does.
    pub(crate) fn candidates(handle: &Handle, shape: &ConvShape) -> Result<Vec<GraphConv>> {
        let op = Operation::new(shape)?;
        let graph = Desc::new(Kind::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
        graph.set_handle(Attr::CUDNN_ATTR_OPERATIONGRAPH_HANDLE, handle)?;
        graph.set_descs(Attr::CUDNN_ATTR_OPERATIONGRAPH_OPS, &[&op.op])?;
        let graph = graph.finalize()?;
        Self::from_graph(handle, &graph)
    }

    /// The plans for a finalized operation graph (see [`GraphConv::candidates`]).
    fn from_graph(handle: &Handle, graph: &Desc) -> Result<Vec<GraphConv>> {
        let heur = Desc::new(Kind::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
        heur.set_descs(Attr::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, &[graph])?;
        // SAFETY: the heuristics mode enum is CUDNN_TYPE_HEUR_MODE's C type.
        unsafe {
            heur.set(
                Attr::CUDNN_ATTR_ENGINEHEUR_MODE,
                Ty::CUDNN_TYPE_HEUR_MODE,
                &[sys::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A],
            )?
        };
        let heur = heur.finalize()?;
        let mut count = 0i64;
        // SAFETY: asking for no elements only returns how many there are.
        check("cudnnBackendGetAttribute", unsafe {
            sys::cudnnBackendGetAttribute(
                heur.0,
                Attr::CUDNN_ATTR_ENGINEHEUR_RESULTS,
                Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                0,
                &mut count,
                std::ptr::null_mut(),
            )
        })?;
        let wanted = (count.max(0) as usize).min(MAX_CANDIDATES);
        let configs = (0..wanted)
            .map(|_| Desc::new(Kind::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR))
            .collect::<Result<Vec<_>>>()?;
        let mut raw: Vec<sys::cudnnBackendDescriptor_t> = configs.iter().map(|c| c.0).collect();
        let mut got = 0i64;
        // SAFETY: `raw` holds `wanted` created engine-config descriptors for cuDNN to fill.
        check("cudnnBackendGetAttribute", unsafe {
            sys::cudnnBackendGetAttribute(
                heur.0,
                Attr::CUDNN_ATTR_ENGINEHEUR_RESULTS,
                Ty::CUDNN_TYPE_BACKEND_DESCRIPTOR,
                wanted as i64,
                &mut got,
                raw.as_mut_ptr().cast(),
            )
        })?;
        let mut plans = Vec::new();
        for cfg in configs.iter().take(got.max(0) as usize) {
            let Ok(plan) = Desc::new(Kind::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR) else {
                continue;
            };
            let finalized = plan
                .set_handle(Attr::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, handle)
                .and_then(|()| {
                    plan.set_descs(Attr::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, &[cfg])
                })
                .and_then(|()| plan.finalize());
            // An engine that cannot run this shape here is passed over.
            let Ok(plan) = finalized else { continue };
            let Ok(ws) = plan.get_i64(Attr::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE) else {
                continue;
            };
            if (0..=MAX_WORKSPACE).contains(&ws) {
                plans.push(GraphConv {
                    plan,
                    workspace: ws as usize,
                });
            }
        }
        Ok(plans)
    }
}

/// A finalized forward-convolution operation with the descriptors it was built from (kept
/// alive with it).
struct Operation {
    op: Desc,
    _parts: [Desc; 4],
}

impl Operation {
    fn new(shape: &ConvShape) -> Result<Operation> {
        let x = tensor(UID_X, shape.dtype, dims(shape.x), shape.nhwc)?;
        let w = tensor(UID_W, shape.dtype, dims(shape.w), shape.nhwc)?;
        let y = tensor(UID_Y, shape.dtype, dims(shape.y), shape.nhwc)?;
        let conv = Desc::new(Kind::CUDNN_BACKEND_CONVOLUTION_DESCRIPTOR)?;
        // SAFETY: each value is its type's C type (the enums are `repr(u32)` like cuDNN's).
        unsafe {
            conv.set(
                Attr::CUDNN_ATTR_CONVOLUTION_COMP_TYPE,
                Ty::CUDNN_TYPE_DATA_TYPE,
                &[DataType::CUDNN_DATA_FLOAT],
            )?;
            conv.set(
                Attr::CUDNN_ATTR_CONVOLUTION_CONV_MODE,
                Ty::CUDNN_TYPE_CONVOLUTION_MODE,
                &[sys::cudnnConvolutionMode_t::CUDNN_CROSS_CORRELATION],
            )?;
        }
        let (s, p) = (shape.stride as i64, shape.padding as i64);
        conv.set_i64(Attr::CUDNN_ATTR_CONVOLUTION_SPATIAL_DIMS, &[2])?;
        conv.set_i64(Attr::CUDNN_ATTR_CONVOLUTION_DILATIONS, &[1, 1])?;
        conv.set_i64(Attr::CUDNN_ATTR_CONVOLUTION_FILTER_STRIDES, &[s, s])?;
        conv.set_i64(Attr::CUDNN_ATTR_CONVOLUTION_PRE_PADDINGS, &[p, p])?;
        conv.set_i64(Attr::CUDNN_ATTR_CONVOLUTION_POST_PADDINGS, &[p, p])?;
        let conv = conv.finalize()?;
        let op = Desc::new(Kind::CUDNN_BACKEND_OPERATION_CONVOLUTION_FORWARD_DESCRIPTOR)?;
        op.set_descs(Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_X, &[&x])?;
        op.set_descs(Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_W, &[&w])?;
        op.set_descs(Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_Y, &[&y])?;
        op.set_descs(
            Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_CONV_DESC,
            &[&conv],
        )?;
        // SAFETY: f32 is CUDNN_TYPE_FLOAT's C type.
        unsafe {
            op.set(
                Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_ALPHA,
                Ty::CUDNN_TYPE_FLOAT,
                &[1.0f32],
            )?;
            op.set(
                Attr::CUDNN_ATTR_OPERATION_CONVOLUTION_FORWARD_BETA,
                Ty::CUDNN_TYPE_FLOAT,
                &[0.0f32],
            )?;
        }
        Ok(Operation {
            op: op.finalize()?,
            _parts: [x, w, y, conv],
        })
    }
}

impl GraphConv {
    /// Workspace bytes the plan needs.
    pub(crate) fn workspace(&self) -> usize {
        self.workspace
    }

    /// Enqueues the convolution on `handle`'s stream: `y` from `x` and `w`.
    ///
    /// # Safety
    /// `x`, `w` and `y` must be device memory of the handle's context holding the plan's
    /// shapes in its type and layout, `workspace` at least [`GraphConv::workspace`] bytes (or
    /// 0 if that is 0), all valid until the stream has run it; `y` must not overlap the others.
    pub(crate) unsafe fn execute(
        &self,
        handle: &Handle,
        (x, w, y): (u64, u64, u64),
        workspace: u64,
    ) -> Result<()> {
        let pack = variant_pack((x, w, y), workspace)?;
        // SAFETY: a finalized plan of this handle's device and a finalized pack whose pointers
        // meet the caller's contract.
        check("cudnnBackendExecute", unsafe {
            sys::cudnnBackendExecute(handle.raw(), self.plan.0, pack.0)
        })
    }
}

/// The pointers one execution of a plan reads and writes, by the tensors' identifiers.
fn variant_pack((x, w, y): (u64, u64, u64), workspace: u64) -> Result<Desc> {
    let pack = Desc::new(Kind::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)?;
    pack.set_i64(
        Attr::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS,
        &[UID_X, UID_W, UID_Y],
    )?;
    let ptrs: [*mut c_void; 3] = [x as *mut c_void, w as *mut c_void, y as *mut c_void];
    // SAFETY: addresses are CUDNN_TYPE_VOID_PTR's C type; cuDNN only stores them here.
    unsafe {
        pack.set(
            Attr::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS,
            Ty::CUDNN_TYPE_VOID_PTR,
            &ptrs,
        )?;
        pack.set(
            Attr::CUDNN_ATTR_VARIANT_PACK_WORKSPACE,
            Ty::CUDNN_TYPE_VOID_PTR,
            &[workspace as *mut c_void],
        )?;
    }
    pack.finalize()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The descriptors up to the operation need no device, only libcudnn: where it loads, the
    /// bundled classifier's 16-channel 3×3 layer in both 16-bit types and both layouts builds
    /// and finalizes (the attribute types and values are what cuDNN accepts).
    #[test]
    fn a_convolution_operation_finalizes_where_cudnn_loads() {
        if crate::cudnn::available().is_err() {
            println!("skipped: libcudnn.so.9 is not on the loader's path");
            return;
        }
        for dtype in [DataType::CUDNN_DATA_HALF, DataType::CUDNN_DATA_BFLOAT16] {
            for nhwc in [true, false] {
                let shape = ConvShape {
                    x: [256, 16, 56, 56],
                    w: [16, 16, 3, 3],
                    y: [256, 16, 56, 56],
                    stride: 1,
                    padding: 1,
                    dtype,
                    nhwc,
                };
                match Operation::new(&shape) {
                    Ok(_) => {}
                    // libcudnn found, but not the engine libraries it loads (or their libcuda).
                    Err(e) if e.to_string().contains("SUBLIBRARY_LOADING_FAILED") => {
                        println!("skipped: cuDNN's engine libraries do not load here ({e})");
                        return;
                    }
                    Err(e) => panic!("{dtype:?}, nhwc {nhwc}: {e}"),
                }
            }
        }
        if let Err(e) = variant_pack((0x1000, 0x2000, 0x3000), 0) {
            panic!("variant pack: {e}");
        }
    }

    #[test]
    fn strides_follow_the_layout() {
        assert_eq!(
            strides([2, 16, 56, 56], false),
            [16 * 56 * 56, 56 * 56, 56, 1]
        );
        assert_eq!(
            strides([2, 16, 56, 56], true),
            [56 * 56 * 16, 1, 56 * 16, 16]
        );
    }
}
