//! The benchmark's plots (SVG, no fonts needed): throughput vs payload size, latency CDF.

use std::path::Path;

use plotters::prelude::*;

use crate::suite::{Latency, Results, Throughput};
use crate::{CliError, CliResult};

fn err<E: std::fmt::Display>(e: E) -> CliError {
    CliError::new(format!("plotting: {e}"))
}

const TP: RGBColor = RGBColor(200, 30, 30);
const ICE: RGBColor = RGBColor(30, 90, 200);
const UDS: RGBColor = RGBColor(40, 150, 60);
const MEM: RGBColor = RGBColor(120, 120, 120);

/// GB/s against payload size, one producer, one line per peer.
pub fn throughput(path: &Path, cells: &[Throughput]) -> CliResult<()> {
    let one: Vec<&Throughput> = cells.iter().filter(|c| c.producers == 1).collect();
    if one.is_empty() {
        return Ok(());
    }
    let gb = |c: &Throughput, x: f64| x * c.size as f64 / 1e9;
    let (lo, hi) = one.iter().fold((f64::MAX, 0f64), |(lo, hi), c| {
        (lo.min(c.size as f64), hi.max(c.size as f64))
    });
    let top = one
        .iter()
        .map(|c| c.memcpy.max(gb(c, c.tp)).max(gb(c, c.ice)))
        .fold(0f64, f64::max)
        * 1.1;
    let root = SVGBackend::new(path, (860, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Host hand-off throughput, one producer (GB/s, higher is better)",
            ("sans-serif", 18),
        )
        .margin(14)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d((lo * 0.8..hi * 1.25).log_scale(), 0f64..top.max(1.0))
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("payload bytes")
        .y_desc("GB/s")
        .x_label_formatter(&|x| human(*x))
        .draw()
        .map_err(err)?;
    type GbPerS = Box<dyn Fn(&Throughput) -> f64>;
    let series: [(&str, RGBColor, GbPerS); 4] = [
        ("tensorport", TP, Box::new(move |c| gb(c, c.tp))),
        ("iceoryx2", ICE, Box::new(move |c| gb(c, c.ice))),
        ("Unix socket copy", UDS, Box::new(move |c| gb(c, c.uds))),
        ("memcpy", MEM, Box::new(|c| c.memcpy)),
    ];
    for (name, color, f) in series {
        let pts: Vec<(f64, f64)> = one.iter().map(|c| (c.size as f64, f(c))).collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(err)?
            .label(name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
        chart
            .draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled())))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

/// Fraction of round trips at or under each one-way latency, for the smallest payload.
pub fn latency_cdf(path: &Path, rows: &[Latency]) -> CliResult<()> {
    let Some(size) = rows.iter().map(|r| r.size).min() else {
        return Ok(());
    };
    let mut lines: Vec<(String, RGBColor, bool, &[f64])> = Vec::new();
    for r in rows.iter().filter(|r| r.size == size) {
        let mode = if r.polling { "polling" } else { "blocking" };
        lines.push((format!("tensorport, {mode}"), TP, r.polling, &r.tp));
        lines.push((format!("iceoryx2, {mode}"), ICE, r.polling, &r.ice));
        if let Some(u) = &r.uds {
            lines.push(("Unix socket copy".into(), UDS, true, u));
        }
    }
    let all = lines.iter().flat_map(|l| l.3.iter().copied());
    let (lo, hi) = all.fold((f64::MAX, 0f64), |(lo, hi), x| (lo.min(x), hi.max(x)));
    if hi <= 0.0 {
        return Ok(());
    }
    let root = SVGBackend::new(path, (860, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "One-way latency CDF, {} payload (left is better)",
                human(size as f64)
            ),
            ("sans-serif", 18),
        )
        .margin(14)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d((lo.max(0.05) * 0.8..hi * 1.2).log_scale(), 0f64..1.0)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("one-way latency, µs (half a round trip)")
        .y_desc("fraction of round trips")
        .draw()
        .map_err(err)?;
    for (name, color, solid, v) in lines {
        let n = v.len() as f64;
        // At most ~400 points per line: every k-th sample of the sorted list.
        let k = (v.len() / 400).max(1);
        let pts: Vec<(f64, f64)> = v
            .iter()
            .enumerate()
            .filter(|(i, _)| i % k == 0 || *i == v.len() - 1)
            .map(|(i, &x)| (x.max(lo.max(0.05)), (i + 1) as f64 / n))
            .collect();
        let style = if solid {
            color.stroke_width(2)
        } else {
            color.mix(0.55).stroke_width(2)
        };
        chart
            .draw_series(LineSeries::new(pts, style))
            .map_err(err)?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

fn human(x: f64) -> String {
    let b = x.round() as u64;
    if b >= 1 << 20 && b.is_multiple_of(1 << 20) {
        format!("{} MiB", b >> 20)
    } else if b >= 1 << 20 {
        format!("{:.1} MB", x / 1e6)
    } else if b >= 1024 && b.is_multiple_of(1024) {
        format!("{} KiB", b >> 10)
    } else {
        format!("{b}")
    }
}

/// Writes both plots of `results` into `dir` (throughput against size; latency CDF).
pub fn write(dir: &std::path::Path, results: &Results) -> CliResult<()> {
    std::fs::create_dir_all(dir)?;
    let t = dir.join("throughput_vs_size.svg");
    let l = dir.join("latency_cdf.svg");
    throughput(&t, &results.tput)?;
    latency_cdf(&l, &results.lat)?;
    println!("\nplots: {} and {}", t.display(), l.display());
    Ok(())
}
