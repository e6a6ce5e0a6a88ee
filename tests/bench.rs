//! The benchmark suite cannot rot: its quick mode runs in CI and must produce every row.

use std::process::Command;

#[test]
fn bench_quick_mode_measures_every_peer() {
    let o = Command::new(env!("CARGO_BIN_EXE_tensorport"))
        .args(["--log", "warn", "bench", "--quick"])
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
            2,
            "a throughput and a latency row for {size}:\n{out}"
        );
        let cells: Vec<f64> = rows[0]
            .split('|')
            .filter_map(|c| c.trim().parse().ok())
            .collect();
        // producers, tensorport tensors/s and GB/s, socket msgs/s and GB/s, memcpy GB/s
        assert_eq!(cells.len(), 6, "{}", rows[0]);
        assert!(cells[1..].iter().all(|&x| x > 0.0), "{}", rows[0]);
        assert!(rows[1].matches("µs").count() == 2, "{}", rows[1]);
    }
}
