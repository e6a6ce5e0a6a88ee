//! Running a batch: the layers enqueued on the network's stream, the pooled scores collected.

use super::*;

impl ConvNet {
    /// Runs the network on `batch` images `[C, H, W]` of fp32 (NCHW) at device address `x`,
    /// and returns the last activation averaged over its height and width: `batch` rows of
    /// [`ConvNet::out_channels`] values, one after the other. Returns once the device is done
    /// (with `x`, too). [`ConvNet::launch`] and [`ConvNet::collect`] in one.
    ///
    /// # Safety
    /// `x` must be device memory of this GPU's context holding `batch × C × H × W` floats,
    /// written by work that has completed (or been ordered before this call by a
    /// synchronisation), and not written until this returns.
    pub unsafe fn pooled(&mut self, x: u64, batch: usize) -> Result<Vec<f32>> {
        // SAFETY: the caller's contract, which holds until `collect` has returned below.
        unsafe { self.launch(x, batch)? };
        self.collect()
    }

    /// Whether a batch was launched and not yet collected.
    pub fn in_flight(&self) -> bool {
        self.in_flight.is_some()
    }

    /// Enqueues the network on `batch` images at `x` (as [`ConvNet::pooled`]) and returns
    /// without waiting: the host may prepare the next batch while the device runs this one.
    /// [`ConvNet::collect`] waits and returns the pooled rows. A batch still in flight is
    /// collected (and its rows dropped) first.
    ///
    /// # Safety
    /// As [`ConvNet::pooled`], until [`ConvNet::collect`] has returned (or the network is
    /// dropped, which waits for the device).
    pub unsafe fn launch(&mut self, x: u64, batch: usize) -> Result<()> {
        if self.in_flight.is_some() {
            self.collect()?;
        }
        if batch == 0 {
            self.in_flight = Some((0, Vec::new()));
            return Ok(());
        }
        // SAFETY: the caller's contract.
        let launched = unsafe { self.enqueue(x, batch) };
        if launched.is_err() {
            // What was enqueued before the failure may still read `x`, which the caller may
            // free as soon as this returns.
            let _ = self.stream.synchronize();
        }
        launched
    }

    /// The work of [`ConvNet::launch`] for a batch of at least one image.
    ///
    /// # Safety
    /// As [`ConvNet::launch`].
    pub(super) unsafe fn enqueue(&mut self, x: u64, batch: usize) -> Result<()> {
        self.grow(batch)?;
        self.plan(batch)?;
        let plan = &self.plans[&batch];
        let acts: Vec<u64> = self.acts.iter().map(|b| b.ptr().raw()).collect();
        // Activation 0: the caller's floats, or their copy in the network's type and layout.
        let converts = self.converts_input();
        let act = |i: usize| if i == 0 && !converts { x } else { acts[i] };
        if converts {
            // SAFETY: `x` holds batch × input floats (the caller's contract); acts[0] was
            // sized for `capacity` ≥ batch inputs in the element type (`grow`).
            unsafe {
                launch_convert(
                    &self.convert,
                    &self.stream,
                    (x, acts[0]),
                    batch,
                    (self.input[0], self.input[1] * self.input[2]),
                    self.layout,
                )?
            };
        }
        let stem = self.stem.as_ref().filter(|_| self.own_stem);
        let mut nhwc = i32::from(self.layout == Layout::Nhwc);
        let workspace = self
            .workspace
            .as_ref()
            .map_or((0, 0), |w| (w.ptr().raw(), w.len()));
        let mut refused = Vec::new();
        for (i, l) in self.layers.iter().enumerate() {
            if let (0, Some((weight, kernel))) = (i, stem) {
                let (mut src, mut w, mut b, mut y) =
                    (x, weight.ptr().raw(), l.bias.ptr().raw(), act(1));
                let (mut h, mut wd) = (self.input[1] as u32, self.input[2] as u32);
                let (mut oh, mut ow) = (l.out[1] as u32, l.out[2] as u32);
                let mut params: [*mut std::ffi::c_void; 9] = [
                    (&mut src as *mut u64).cast(),
                    (&mut w as *mut u64).cast(),
                    (&mut b as *mut u64).cast(),
                    (&mut y as *mut u64).cast(),
                    (&mut h as *mut u32).cast(),
                    (&mut wd as *mut u32).cast(),
                    (&mut oh as *mut u32).cast(),
                    (&mut ow as *mut u32).cast(),
                    (&mut nhwc as *mut i32).cast(),
                ];
                let grid = ((oh * ow).div_ceil(128), images(batch)?, 1);
                // SAFETY: the parameters match `tp_net_stem`'s, compiled for this layer's
                // shape (`stem_shape`); `x` holds batch inputs of [C, h, wd] floats (the
                // caller's contract), activation 1 was sized for batch outputs of [K, oh, ow],
                // the weights and bias are the layer's fp32 values; the shapes fit in u32
                // (checked in `new`).
                unsafe { kernel.launch(grid, (128, 1, 1), &self.stream, &mut params)? };
                continue;
            }
            let ptrs = (act(i), act(i + 1), l.spec.residual.map_or(0, act));
            let descs = (&plan.descs[i], &plan.descs[i + 1]);
            let graph = plan.graphs[i].as_ref().filter(|_| l.fused);
            // SAFETY: activation i holds batch inputs of layer i (written by the work before,
            // on this stream); activation i + 1 was sized for them and is written only here;
            // the residual is an earlier activation of its shape (checked in `new`); the
            // workspace was sized for this plan.
            if unsafe { self.run_layer(i, batch, ptrs, descs, plan.algos[i], graph, workspace)? } {
                refused.push(i);
            }
        }
        let last = self.layers.last().expect("at least one layer");
        let rows = batch * last.out[0];
        let pooled = self.pooled.as_ref().expect("made by grow");
        let plane = (last.out[1] * last.out[2]) as u32;
        let channels = last.out[0] as u32;
        let too_large = |_| Error::TooLarge("a batch too large");
        match self.layout {
            Layout::Nchw => {
                let (mut src, mut dst, mut plane) =
                    (act(self.layers.len()), pooled.ptr().raw(), plane);
                let mut params: [*mut std::ffi::c_void; 3] = [
                    (&mut src as *mut u64).cast(),
                    (&mut dst as *mut u64).cast(),
                    (&mut plane as *mut u32).cast(),
                ];
                let grid = (u32::try_from(rows).map_err(too_large)?, 1, 1);
                // SAFETY: the parameters match `tp_net_mean`'s; the last activation holds
                // `rows` planes of `plane` values and `pooled` `rows` floats.
                unsafe {
                    self.mean
                        .launch(grid, (256, 1, 1), &self.stream, &mut params)?
                };
            }
            Layout::Nhwc => {
                let partial = self.partial.as_ref().expect("made by grow for NHWC");
                let chunks = self.mean_chunks() as u32;
                let (mut src, mut part, mut plane_, mut channels_) =
                    (act(self.layers.len()), partial.ptr().raw(), plane, channels);
                let mut params: [*mut std::ffi::c_void; 4] = [
                    (&mut src as *mut u64).cast(),
                    (&mut part as *mut u64).cast(),
                    (&mut plane_ as *mut u32).cast(),
                    (&mut channels_ as *mut u32).cast(),
                ];
                // SAFETY: the parameters match `tp_net_mean_nhwc`'s; the last activation
                // holds batch images of `plane` × `channels` values, and `partial` was sized
                // for `capacity` ≥ batch images of `chunks` × `channels` floats (`grow`).
                unsafe {
                    self.mean_nhwc.launch(
                        (chunks, images(batch)?, 1),
                        (256, 1, 1),
                        &self.stream,
                        &mut params,
                    )?
                };
                let (mut part, mut dst, mut chunks_, mut channels_, mut plane_) = (
                    partial.ptr().raw(),
                    pooled.ptr().raw(),
                    chunks,
                    channels,
                    plane,
                );
                let mut params: [*mut std::ffi::c_void; 5] = [
                    (&mut part as *mut u64).cast(),
                    (&mut dst as *mut u64).cast(),
                    (&mut chunks_ as *mut u32).cast(),
                    (&mut channels_ as *mut u32).cast(),
                    (&mut plane_ as *mut u32).cast(),
                ];
                // SAFETY: the parameters match `tp_net_mean_sum`'s; `partial` holds what the
                // first pass wrote, `pooled` `rows` = batch × `channels` floats.
                unsafe {
                    self.mean_sum.launch(
                        (blocks(channels as usize)?.0, images(batch)?, 1),
                        (256, 1, 1),
                        &self.stream,
                        &mut params,
                    )?
                };
            }
        }
        self.gpu.bind()?;
        let host = self.pooled_host.as_mut().expect("made by grow");
        // SAFETY: `host` is page-locked memory of `capacity` rows ≥ `rows` floats, owned by
        // this network and read only in `collect`, after the stream has run the copy (the
        // network's drop waits for the stream too); `pooled` holds `rows` floats.
        unsafe {
            self.gpu.driver().memcpy_dtoh_async(
                host.as_mut_slice().as_mut_ptr(),
                pooled.ptr().raw(),
                rows * 4,
                self.stream.raw().cast(),
            )?
        };
        self.in_flight = Some((rows, refused));
        Ok(())
    }

    /// Enqueues layer `i` on `batch` images: `x` → `y`, with `z` (0: none) as its residual.
    /// The convolution is the graph plan's where one is given, else cuDNN's fused call where
    /// the layer fuses at this batch size, else cuDNN's convolution; the bias, residual and
    /// ReLU then follow in the epilogue kernel. Returns whether cuDNN refused the fused call
    /// (the layer then ran apart).
    ///
    /// # Safety
    /// `x` must hold `batch` inputs of layer `i` in the network's type and layout, `y` room for
    /// its outputs (not overlapping), `z` an activation of its output's shape (or 0), the
    /// descriptors and algorithm this batch size's; `workspace` at least what the plan needs;
    /// all valid until the stream has run the work.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn run_layer(
        &self,
        i: usize,
        batch: usize,
        (x, y, z): (u64, u64, u64),
        (x_desc, y_desc): (&TensorDesc, &TensorDesc),
        (algo, ws): (Algo, usize),
        graph: Option<&GraphConv>,
        workspace: (u64, usize),
    ) -> Result<bool> {
        let l = &self.layers[i];
        let mut refused = false;
        match graph {
            // SAFETY: the caller's contract; the plan was made for these shapes.
            Some(g) => unsafe {
                g.execute(&self.handle, (x, l.weight.ptr().raw(), y), workspace.0)?
            },
            None => {
                let work = (workspace.0, ws.min(workspace.1));
                if l.fused && fuse_at(self.precision, batch) {
                    let bias = l.bias_t.as_ref().unwrap_or(&l.bias).ptr().raw();
                    // SAFETY: the caller's contract; the weights and bias match their
                    // descriptors.
                    let done = unsafe {
                        self.handle.forward_bias_relu(
                            (x_desc, x),
                            (&l.filter, l.weight.ptr().raw()),
                            (&l.conv, algo),
                            work,
                            ((z != 0).then_some(z), (&l.bias_desc, bias), &self.relu),
                            (y_desc, y),
                        )
                    };
                    match done {
                        Ok(()) => return Ok(false),
                        // cuDNN refused the combination (before enqueuing anything): this
                        // layer runs apart from now on.
                        Err(Error::Cudnn { .. }) => refused = true,
                        Err(e) => return Err(e),
                    }
                }
                // SAFETY: as above.
                unsafe {
                    self.handle.forward(
                        (x_desc, x),
                        (&l.filter, l.weight.ptr().raw()),
                        &l.conv,
                        algo,
                        work,
                        (y_desc, y),
                    )?
                };
            }
        }
        let plane = l.out[1] * l.out[2];
        let per_image = l.out[0] * plane;
        let (mut y, mut b, mut z) = (y, l.bias.ptr().raw(), z);
        let (mut p, mut c) = (plane as u32, l.out[0] as u32);
        let mut nhwc = i32::from(self.layout == Layout::Nhwc);
        let mut params: [*mut std::ffi::c_void; 6] = [
            (&mut y as *mut u64).cast(),
            (&mut b as *mut u64).cast(),
            (&mut z as *mut u64).cast(),
            (&mut p as *mut u32).cast(),
            (&mut c as *mut u32).cast(),
            (&mut nhwc as *mut i32).cast(),
        ];
        let grid = (blocks(per_image)?.0, images(batch)?, 1);
        // SAFETY: the parameters match `tp_net_epilogue`'s; `y` and `z` hold batch images of
        // `per_image` elements (checked shapes, which fit in u32), `b` the layer's channels.
        unsafe {
            self.epilogue
                .launch(grid, (256, 1, 1), &self.stream, &mut params)?
        };
        Ok(refused)
    }

    /// Waits for the batch [`ConvNet::launch`] enqueued and returns its pooled rows (nothing if
    /// none is in flight).
    pub fn collect(&mut self) -> Result<Vec<f32>> {
        let Some((rows, refused)) = self.in_flight.take() else {
            return Ok(Vec::new());
        };
        self.stream.synchronize()?;
        for i in refused {
            tracing::debug!(
                layer = i,
                "cuDNN refused the fused convolution; running it apart"
            );
            self.layers[i].fused = false;
        }
        let Some(host) = self.pooled_host.as_mut() else {
            return Ok(Vec::new());
        };
        Ok(host.as_mut_slice()[..rows * 4]
            .chunks_exact(4)
            .map(|b| f32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }
}
