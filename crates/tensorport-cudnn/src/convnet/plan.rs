//! Choosing each layer's convolution for a batch size: cuDNN's legacy algorithms measured, and
//! the graph API's plans where a 16-bit layer runs faster on them; the buffers grown to fit.

use super::*;

impl ConvNet {
    /// Measures the algorithms for batches of `batch` images now (they then serve every
    /// batch size), rather than at the first batch.
    pub fn prepare(&mut self, batch: usize) -> Result<()> {
        // Growing replaces the buffers a batch in flight writes.
        self.collect()?;
        self.grow(batch)?;
        self.plan(batch).map(|_| ())
    }

    /// Makes room for `batch` images.
    pub(super) fn grow(&mut self, batch: usize) -> Result<()> {
        let input: usize = self.input.iter().product();
        let elem = self.precision.bytes();
        let input_copy = |n: usize| {
            if self.converts_input() {
                n * input * elem
            } else {
                1
            }
        };
        if batch <= self.capacity
            && !self.acts.is_empty()
            && self.acts[0].len() >= input_copy(self.capacity)
        {
            return Ok(());
        }
        // The stream may still read the old buffers.
        self.stream.synchronize()?;
        let n = batch.max(self.capacity).max(1);
        let mut acts = Vec::with_capacity(self.layers.len() + 1);
        acts.push(DeviceBuffer::new(&self.gpu, input_copy(n))?);
        for l in &self.layers {
            acts.push(DeviceBuffer::new(
                &self.gpu,
                n * l.out.iter().product::<usize>() * elem,
            )?);
        }
        self.pooled = Some(DeviceBuffer::new(&self.gpu, n * self.out_channels() * 4)?);
        self.partial = match self.layout {
            Layout::Nhwc => Some(DeviceBuffer::new(
                &self.gpu,
                n * self.mean_chunks() * self.out_channels() * 4,
            )?),
            Layout::Nchw => None,
        };
        self.pooled_host = Some(PinnedBuffer::new(&self.gpu, n * self.out_channels() * 4)?);
        self.acts = acts;
        self.capacity = n;
        Ok(())
    }

    /// The plan for `batch` images, made (and its algorithms measured) the first time.
    pub(super) fn plan(&mut self, batch: usize) -> Result<&Plan> {
        if !self.plans.contains_key(&batch) {
            let dtype = self.precision.data_type();
            let mut descs = vec![TensorDesc::new(
                dtype,
                self.layout.format(),
                [batch, self.input[0], self.input[1], self.input[2]],
            )?];
            for l in &self.layers {
                descs.push(TensorDesc::new(
                    dtype,
                    self.layout.format(),
                    [batch, l.out[0], l.out[1], l.out[2]],
                )?);
            }
            // Measuring takes cuDNN a tenth of a second or more — a stall in a serving loop — so
            // it is done once, for the first power of two asked for (`prepare`: the largest
            // batch), and its algorithms serve every other size where cuDNN accepts them; a
            // size that refuses one gets that layer measured for it.
            let bucket = match self.found.keys().filter(|&&b| b >= batch).min() {
                Some(&b) => b,
                None => match self.found.keys().max() {
                    Some(&b) => b,
                    None => {
                        let b = batch.next_power_of_two();
                        let found = self.measure(b)?;
                        self.found.insert(b, found);
                        b
                    }
                },
            };
            let mut algos = Vec::with_capacity(self.layers.len());
            for (i, l) in self.layers.iter().enumerate() {
                let algo = self.found[&bucket][i];
                let ws = match self.handle.workspace_size(
                    &descs[i],
                    &l.filter,
                    &l.conv,
                    &descs[i + 1],
                    algo,
                ) {
                    Ok(ws) => (algo, ws),
                    Err(_) => {
                        let best = self.fastest(&descs[i], l, &descs[i + 1])?;
                        let ws = self.handle.workspace_size(
                            &descs[i],
                            &l.filter,
                            &l.conv,
                            &descs[i + 1],
                            best,
                        )?;
                        (best, ws)
                    }
                };
                algos.push(ws);
            }
            let started = std::time::Instant::now();
            let candidates = self.graph_candidates(batch);
            if candidates.iter().any(|c| !c.is_empty()) {
                tracing::debug!(
                    batch,
                    plans = candidates.iter().map(Vec::len).sum::<usize>(),
                    ms = started.elapsed().as_secs_f64() * 1e3,
                    "cuDNN graph plans made"
                );
            }
            let need = algos
                .iter()
                .map(|a| a.1)
                .chain(candidates.iter().flatten().map(GraphConv::workspace))
                .max()
                .unwrap_or(0);
            if self.workspace.as_ref().is_none_or(|w| w.len() < need) {
                self.stream.synchronize()?;
                self.workspace = None;
                self.workspace = Some(DeviceBuffer::new(&self.gpu, need.max(1))?);
            }
            let graphs = self.choose_graphs(batch, &descs, &algos, candidates)?;
            self.plans.insert(
                batch,
                Plan {
                    descs,
                    algos,
                    graphs,
                },
            );
        }
        Ok(&self.plans[&batch])
    }

    /// Each layer's graph-API plans for `batch` images (cuDNN's heuristics' order), where the
    /// graph API may run it: 16-bit layers cuDNN runs (not the stem kernel's), and once the
    /// first batch size has been measured, only the layers it found faster that way. Empty
    /// where none (a failure of the graph API leaves the layer to the legacy calls).
    pub(super) fn graph_candidates(&self, batch: usize) -> Vec<Vec<GraphConv>> {
        let converts = self.converts_input();
        (0..self.layers.len())
            .map(|i| {
                let l = &self.layers[i];
                let eligible = self.precision.bytes() == 2
                    && l.fused
                    && (i > 0 || converts)
                    && self.graph_chosen.as_ref().is_none_or(|c| c[i]);
                if !eligible {
                    return Vec::new();
                }
                let [c, h, w] = if i == 0 {
                    self.input
                } else {
                    self.layers[i - 1].out
                };
                let shape = ConvShape {
                    x: [batch, c, h, w],
                    w: [l.spec.out_channels, c, l.spec.kernel, l.spec.kernel],
                    y: [batch, l.out[0], l.out[1], l.out[2]],
                    stride: l.spec.stride,
                    padding: l.spec.padding,
                    dtype: self.precision.data_type(),
                    nhwc: self.layout == Layout::Nhwc,
                };
                GraphConv::candidates(&self.handle, &shape).unwrap_or_else(|e| {
                    tracing::debug!(layer = i, "no cuDNN graph plans: {e}");
                    Vec::new()
                })
            })
            .collect()
    }

    /// Each layer's graph plan for `batch` images, if any. The first time, each candidate is
    /// timed against the legacy calls on this network's buffers, and a layer takes a graph
    /// plan only if it is at least 5% faster; later batch sizes take those layers' first
    /// candidate (the heuristics' choice) without timing.
    pub(super) fn choose_graphs(
        &mut self,
        batch: usize,
        descs: &[TensorDesc],
        algos: &[(Algo, usize)],
        candidates: Vec<Vec<GraphConv>>,
    ) -> Result<Vec<Option<GraphConv>>> {
        if self.graph_chosen.is_some() || candidates.iter().all(Vec::is_empty) {
            return Ok(candidates
                .into_iter()
                .map(|c| c.into_iter().next())
                .collect());
        }
        let mut chosen = Vec::with_capacity(candidates.len());
        for (i, cands) in candidates.into_iter().enumerate() {
            if cands.is_empty() {
                chosen.push(None);
                continue;
            }
            let descs = (&descs[i], &descs[i + 1]);
            let legacy = self.time_layer(i, batch, descs, algos[i], None)?;
            let mut best: Option<(f32, GraphConv)> = None;
            for g in cands {
                // A plan that fails to run is passed over.
                let Ok(t) = self.time_layer(i, batch, descs, algos[i], Some(&g)) else {
                    continue;
                };
                if best.as_ref().is_none_or(|b| t < b.0) {
                    best = Some((t, g));
                }
            }
            tracing::debug!(
                layer = i,
                batch,
                legacy_ms = legacy,
                graph_ms = best.as_ref().map(|b| b.0),
                "cuDNN's legacy call against its graph API's best plan"
            );
            chosen.push(best.filter(|b| b.0 < 0.95 * legacy).map(|b| b.1));
        }
        let layers: Vec<usize> = (0..chosen.len()).filter(|&i| chosen[i].is_some()).collect();
        tracing::info!(?layers, batch, "convolutions on cuDNN's graph API plans");
        self.graph_chosen = Some(chosen.iter().map(Option::is_some).collect());
        Ok(chosen)
    }

    /// Milliseconds layer `i` takes on `batch` images with `graph` (or the legacy calls),
    /// after a run to warm up, over [`TIMING_RUNS`] runs on the network's own buffers.
    pub(super) fn time_layer(
        &self,
        i: usize,
        batch: usize,
        descs: (&TensorDesc, &TensorDesc),
        algo: (Algo, usize),
        graph: Option<&GraphConv>,
    ) -> Result<f32> {
        let acts: Vec<u64> = self.acts.iter().map(|b| b.ptr().raw()).collect();
        let l = &self.layers[i];
        let ptrs = (acts[i], acts[i + 1], l.spec.residual.map_or(0, |r| acts[r]));
        let workspace = self
            .workspace
            .as_ref()
            .map_or((0, 0), |w| (w.ptr().raw(), w.len()));
        // SAFETY: the network's own activations, sized by `grow` for at least `batch` images
        // (activation i is layer i's input: `graph_candidates` leaves out a layer 0 that would
        // read the caller's input); the workspace was sized for every candidate; the stream
        // is waited for before this returns. What the runs compute is thrown away.
        let run = || unsafe { self.run_layer(i, batch, ptrs, descs, algo, graph, workspace) };
        let result = (|| -> Result<f32> {
            run()?;
            let start = self.stream.record()?;
            for _ in 0..TIMING_RUNS {
                run()?;
            }
            let end = self.stream.record()?;
            end.wait()?;
            Ok(end.elapsed_since(&start)?)
        })();
        // Whatever failed, nothing may still be running on the buffers.
        self.stream.synchronize()?;
        Ok(result? / TIMING_RUNS as f32)
    }

    /// The fastest algorithm of each layer for `batch` images.
    pub(super) fn measure(&self, batch: usize) -> Result<Vec<Algo>> {
        let dtype = self.precision.data_type();
        let mut x = TensorDesc::new(
            dtype,
            self.layout.format(),
            [batch, self.input[0], self.input[1], self.input[2]],
        )?;
        let mut out = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            let y = TensorDesc::new(
                dtype,
                self.layout.format(),
                [batch, l.out[0], l.out[1], l.out[2]],
            )?;
            out.push(self.fastest(&x, l, &y)?);
            x = y;
        }
        Ok(out)
    }

    /// The fastest algorithm cuDNN measures for `l` between `x` and `y`, keeping to the
    /// precision's arithmetic.
    pub(super) fn fastest(&self, x: &TensorDesc, l: &Layer, y: &TensorDesc) -> Result<Algo> {
        let found = self.handle.find_algorithms(x, &l.filter, &l.conv, y)?;
        let math = self.precision.math();
        found
            .iter()
            .find(|f| f.1 == math)
            .or(found.first())
            .map(|f| f.0)
            .ok_or_else(|| Error::Cudnn {
                call: "cudnnFindConvolutionForwardAlgorithm",
                status: format!(
                    "no algorithm for a {}x{} convolution in {}",
                    l.spec.kernel, l.spec.kernel, self.precision
                ),
            })
    }
}
