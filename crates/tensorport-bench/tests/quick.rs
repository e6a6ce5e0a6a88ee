//! The benchmark suite cannot rot: its quick mode runs in CI and must measure every peer, in
//! every row, and draw both plots.

use std::process::Command;

#[test]
fn bench_quick_mode_measures_every_peer() {
    let plots = tempfile::tempdir().unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_tensorport-bench"))
        .args(["--quick", "--plots"])
        .arg(plots.path())
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{out}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    for size in ["4096 B", "65536 B"] {
        let rows: Vec<&str> = out
            .lines()
            .filter(|l| l.starts_with(&format!("| {size}")))
            .collect();
        assert_eq!(
            rows.len(),
            3,
            "a throughput row and two latency rows (polling, blocking) for {size}:\n{out}"
        );
        let cells: Vec<f64> = rows[0]
            .split('|')
            .filter_map(|c| c.trim().parse().ok())
            .collect();
        // producers; tensorport, iceoryx2 and socket msgs/s and GB/s; memcpy GB/s; the ratio.
        // Every peer measured something: a cell is a positive number however slow the machine
        // (the table keeps three significant digits, so a slow run reads 0.00412, not 0.00).
        assert_eq!(
            cells.len(),
            9,
            "expected 9 numeric cells (producers; tensorport, iceoryx2 and socket msgs/s and \
             GB/s; memcpy GB/s; the ratio) in the {size} throughput row, got {cells:?}:\n{}",
            rows[0]
        );
        let names = [
            "producers",
            "tensorport msgs/s",
            "tensorport GB/s",
            "iceoryx2 msgs/s",
            "iceoryx2 GB/s",
            "socket msgs/s",
            "socket GB/s",
            "memcpy GB/s",
            "tensorport / iceoryx2",
        ];
        for (name, x) in names.iter().zip(&cells) {
            assert!(
                *x > 0.0,
                "expected a positive {name} for {size}, got {x}:\n{}",
                rows[0]
            );
        }
        assert!(
            rows[1].contains("| polling |"),
            "expected the polling latency row second for {size}:\n{}",
            rows[1]
        );
        assert_eq!(
            rows[1].matches("µs").count(),
            2,
            "expected tensorport and iceoryx2 polling latencies for {size}:\n{}",
            rows[1]
        );
        assert!(
            rows[2].contains("| blocking |"),
            "expected the blocking latency row third for {size}:\n{}",
            rows[2]
        );
        assert_eq!(
            rows[2].matches("µs").count(),
            3,
            "expected tensorport, iceoryx2 and socket blocking latencies for {size}:\n{}",
            rows[2]
        );
    }
    for plot in ["throughput_vs_size.svg", "latency_cdf.svg"] {
        let svg = std::fs::read_to_string(plots.path().join(plot)).unwrap();
        assert!(
            svg.starts_with("<svg") && svg.contains("tensorport") && svg.contains("iceoryx2"),
            "{plot}"
        );
        assert!(
            svg.matches("<polyline").count() >= 3,
            "{plot} has its lines"
        );
    }
}
