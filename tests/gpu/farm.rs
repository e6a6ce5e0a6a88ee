//! The farm on the GPU: the CUDA model, nvJPEG decoding producers, two GPUs.

use super::*;

/// The farm with `--device cuda` (a dfdx `Cuda` model fed from pinned pools) gives the CPU
/// model's scores, within 1e-3 (relative) — different kernels sum in different orders — and
/// the same classes.
pub(crate) fn farm_on_cuda() {
    // (precision, bound on the relative difference from the CPU model).
    for (precision, bound) in [
        ("f32", 1e-3f32),
        ("tf32", 2e-2),
        ("f16", 2e-2),
        ("bf16", 1e-1),
    ] {
        for pixels in ["f32", "u8"] {
            farm_on_cuda_with(pixels, precision, bound);
        }
    }
}

/// The farm on the CUDA model at `precision`, producers handing over `pixels` (u8 planes are
/// normalised on the GPU), against the CPU model in-process: every score within `bound`
/// (relative), and at fp32 every class the CPU model's.
pub(crate) fn farm_on_cuda_with(pixels: &str, precision: &str, bound: f32) {
    use tensorport_dfdx::dfdx::prelude::Cpu;
    use tensorport_dfdx::{ImageClassifier, ModelConfig};
    let exe = tensorport_exe();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("gpu.jsonl");
    let n = 256;
    let size = 64usize;
    let o = std::process::Command::new(&exe)
        .args(["farm", "--device", "cuda", "--synthetic", &n.to_string()])
        .args([
            "--image-size",
            &size.to_string(),
            "--producers",
            "4",
            "--progress",
            "never",
            "--pixels",
            pixels,
            "--precision",
            precision,
        ])
        .arg("--output")
        .arg(&out)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "farm --device cuda failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    if precision == "f32" {
        println!(
            "{}",
            stdout
                .lines()
                .map(|l| format!("  {l}"))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
    let cfg = ModelConfig {
        image_size: size,
        classes: 10,
        width: 16,
    };
    let model = ImageClassifier::from_seed(&Cpu::default(), cfg, 0).unwrap();
    let mut px = vec![0f32; 3 * size * size];
    let (mut worst, mut same_class, mut lines) = (0f32, 0, 0);
    for line in std::fs::read_to_string(&out).unwrap().lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let src: tensorport_vision::Source = v["input"].as_str().unwrap().parse().unwrap();
        tensorport_vision::prepare(&src, size as u32, &mut px).unwrap();
        let want = &model.forward_flat(px.clone(), 1)[0];
        let got = line_scores(&v);
        for (g, w) in got.iter().zip(want) {
            worst = worst.max((g - w).abs() / (1.0 + w.abs()));
        }
        let argmax = |s: &[f32]| {
            s.iter()
                .enumerate()
                .max_by(|a, b| a.1.total_cmp(b.1))
                .unwrap()
                .0
        };
        same_class += (argmax(&got) == argmax(want)) as usize;
        lines += 1;
    }
    println!("  --precision {precision} --pixels {pixels}: {lines} results; max relative difference from the CPU model {worst:.2e}; same class {same_class}/{lines}");
    assert_eq!(lines, n);
    assert!(
        worst <= bound,
        "--precision {precision}: GPU scores differ from the CPU model by {worst} (bound {bound})"
    );
    if precision == "f32" {
        assert_eq!(same_class, n);
    }
}

/// `prep --nvjpeg --dump` against `prep --dump` (the CPU producers' tensors) on the same JPEGs:
/// the two decoders and resamplers agree to within a few 8-bit levels.
pub(crate) fn nvjpeg_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let (_, jpegs) = sample_images(dir.path(), 48);
    let (g, c) = (dir.path().join("g.st"), dir.path().join("c.st"));
    let said = tp(&[
        "prep",
        "--input",
        &jpegs,
        "--nvjpeg",
        "--batch",
        "8",
        "--repeat",
        "1",
        "--dump",
        g.to_str().unwrap(),
    ]);
    println!("  {}", said.trim().replace('\n', "\n  "));
    tp(&[
        "prep",
        "--input",
        &jpegs,
        "--repeat",
        "1",
        "--dump",
        c.to_str().unwrap(),
    ]);
    let (gb, cb) = (std::fs::read(&g).unwrap(), std::fs::read(&c).unwrap());
    let (mean, worst) = distance(&gb, &cb, 24);
    println!("  24 files: mean |GPU - CPU| {mean:.4}, largest {worst:.3} (one 8-bit level is about 0.017)");
    assert!(mean <= 0.02, "mean difference {mean}");
    assert!(worst <= 0.5, "largest difference {worst}");
}

/// `prep --nvjpeg --gpu-decode by-chroma` on 4:4:4 JPEGs: the hybrid decoders (host threads and
/// CUDA cores) take some of them, and every tensor lies as close to the CPU path's as the
/// engines' do. Half the files are over a megapixel, which the GPU Huffman-decodes.
pub(crate) fn nvjpeg_hybrid_444() {
    hybrid_against_engines(
        jpeg_encoder::SamplingFactor::R_4_4_4,
        "4:4:4",
        "by-chroma",
        &[],
    );
}

/// `prep --nvjpeg --gpu-decode split --gpu-upsampling replicate` on 4:2:0 JPEGs: the hybrid
/// decoders take some, and their tensors match the engines' replicating decoder's.
pub(crate) fn nvjpeg_split_420() {
    hybrid_against_engines(
        jpeg_encoder::SamplingFactor::R_4_2_0,
        "4:2:0",
        "split",
        &["--gpu-upsampling", "replicate"],
    );
}

/// `prep --nvjpeg` on batches that mix 4:4:4, 4:2:2 and 4:2:0 JPEGs of odd and even sizes,
/// small and over a megapixel, against `prep` on the CPU: every chroma of a batch lies as
/// near the CPU's tensors, with interpolated chroma, as one chroma alone does.
pub(crate) fn nvjpeg_mixed_chroma() {
    use jpeg_encoder::SamplingFactor::{R_4_2_0, R_4_2_2, R_4_4_4};
    let dir = tempfile::tempdir().unwrap();
    let n = 36u32;
    let jpegs = write_jpegs(dir.path(), n, |i| {
        let size = match i % 4 {
            0 => (333 + 2 * (i % 5) as u16, 251 + (i % 3) as u16),
            1 => (224, 224),
            2 => (1201 + 37 * (i % 7) as u16, 899 + 29 * (i % 5) as u16),
            _ => (640 + (i % 2) as u16, 481),
        };
        (size, [R_4_4_4, R_4_2_2, R_4_2_0][(i % 3) as usize])
    });
    let (cpu, _) = prep_dump(dir.path(), &jpegs, "c.st", &["--batch", "12"]);
    let (gpu, said) = prep_dump(dir.path(), &jpegs, "g.st", &["--batch", "12", "--nvjpeg"]);
    println!("  {}", said.trim().replace('\n', "\n  "));
    let (mean, worst) = distance(&gpu, &cpu, n as usize);
    println!("  {n} files, 4:4:4, 4:2:2 and 4:2:0 in each batch: mean |GPU - CPU| {mean:.4}, largest {worst:.3}");
    assert!(mean <= 0.02, "mean difference {mean}");
    assert!(worst <= 0.5, "largest difference {worst}");
}

/// `n` photo-like JPEGs written into `dir`/files, file `i` at the size and chroma `of(i)`
/// gives; the folder's path.
fn write_jpegs(
    dir: &std::path::Path,
    n: u32,
    of: impl Fn(u32) -> ((u16, u16), jpeg_encoder::SamplingFactor),
) -> String {
    let jpegs = dir.join("files");
    std::fs::create_dir(&jpegs).unwrap();
    for i in 0..n {
        let ((w, h), sampling) = of(i);
        let rgb: Vec<u8> = (0..u32::from(w) * u32::from(h))
            .flat_map(|p| {
                let (x, y) = (p % u32::from(w), p / u32::from(w));
                [(x * 3 + i) as u8, (y * 2) as u8, ((x ^ y) + 7 * i) as u8]
            })
            .collect();
        let mut enc =
            jpeg_encoder::Encoder::new_file(jpegs.join(format!("f{i:02}.jpg")), 90).unwrap();
        enc.set_sampling_factor(sampling);
        enc.encode(&rgb, w, h, jpeg_encoder::ColorType::Rgb)
            .unwrap();
    }
    jpegs.to_str().unwrap().to_string()
}

/// `prep` over the folder `jpegs`, once, with `flags`, its tensors dumped to `dir`/`name`: the
/// dump's bytes and what `prep` said.
fn prep_dump(dir: &std::path::Path, jpegs: &str, name: &str, flags: &[&str]) -> (Vec<u8>, String) {
    let out = dir.join(name);
    let mut args = vec!["prep", "--input", jpegs, "--repeat", "1"];
    args.extend_from_slice(flags);
    args.extend_from_slice(&["--dump", out.to_str().unwrap()]);
    let said = tp(&args);
    (std::fs::read(&out).unwrap(), said)
}

/// 32 JPEGs of `sampling` (half of them over a megapixel) through `prep` on the CPU, on the
/// engines and with `--gpu-decode mode`, both GPU runs with `flags`: the hybrid decoders must
/// take some, and their tensors lie near the engines' (the same chroma upsampling) and, where
/// chroma is interpolated (no `flags`), on average near the CPU's.
fn hybrid_against_engines(
    sampling: jpeg_encoder::SamplingFactor,
    chroma: &str,
    mode: &str,
    flags: &[&str],
) {
    let dir = tempfile::tempdir().unwrap();
    let jpegs = write_jpegs(dir.path(), 32, |i| {
        let size = if i % 2 == 0 {
            (200 + 37 * (i % 7) as u16, 150 + 29 * (i % 5) as u16)
        } else {
            (1200 + 37 * (i % 7) as u16, 900 + 29 * (i % 5) as u16)
        };
        (size, sampling)
    });
    let dump = |name: &str, extra: &[&str]| {
        let mut args = vec!["--batch", "16"];
        args.extend_from_slice(extra);
        prep_dump(dir.path(), &jpegs, name, &args)
    };
    let (cpu, _) = dump("c.st", &[]);
    let mut on_engines = vec!["--nvjpeg", "--gpu-decode", "engines"];
    on_engines.extend_from_slice(flags);
    let (engines, _) = dump("e.st", &on_engines);
    let mut hybrid_flags = vec!["--nvjpeg", "--gpu-decode", mode, "--cpu-threads", "4"];
    hybrid_flags.extend_from_slice(flags);
    let (hybrid, said) = dump("h.st", &hybrid_flags);
    println!("  {}", said.trim().replace('\n', "\n  "));
    let share = said
        .lines()
        .find_map(|l| l.strip_prefix("hybrid decoder: "))
        .and_then(|l| l.split(' ').next())
        .and_then(|n| n.parse::<u32>().ok());
    assert!(
        share.is_some_and(|n| n > 0),
        "the hybrid decoder took none:\n{said}"
    );
    for (label, bytes) in [("engines", &engines), (mode, &hybrid)] {
        let (mean, worst) = distance(bytes, &cpu, 32);
        println!("  {label}: 32 files at {chroma}, mean |GPU - CPU| {mean:.4}, largest {worst:.3}");
        // Replicated chroma is further from the CPU's interpolation on these sharp patterns
        // (the engines' own replicating decoder included): only the interpolating runs are
        // held to the CPU's tensors.
        if flags.is_empty() {
            assert!(mean <= 0.02, "{label}: mean difference {mean}");
        }
    }
    let (mean, worst) = distance(&hybrid, &engines, 32);
    println!("  {mode} against the engines: mean {mean:.4}, largest {worst:.3}");
    assert!(
        mean <= 0.01,
        "{mode}: mean difference from the engines {mean}"
    );
    assert!(
        worst <= 0.1,
        "{mode}: largest difference from the engines {worst}"
    );
}

/// The mean and largest |difference| between two safetensors dumps of the same `files` tensors.
fn distance(gpu: &[u8], cpu: &[u8], files: usize) -> (f64, f32) {
    let (g, c) = (
        safetensors::SafeTensors::deserialize(gpu).unwrap(),
        safetensors::SafeTensors::deserialize(cpu).unwrap(),
    );
    assert_eq!((g.names().len(), c.names().len()), (files, files));
    let (mut sum, mut n, mut worst) = (0f64, 0usize, 0f32);
    for name in c.names() {
        let a: &[f32] = bytemuck::cast_slice(g.tensor(name).unwrap().data());
        let b: &[f32] = bytemuck::cast_slice(c.tensor(name).unwrap().data());
        assert_eq!(a.len(), b.len(), "{name}");
        for (x, y) in a.iter().zip(b) {
            let d = (x - y).abs();
            sum += f64::from(d);
            n += 1;
            worst = worst.max(d);
        }
    }
    (sum / n.max(1) as f64, worst)
}

/// Grayscale JPEGs among `farm_gpu_producers`' inputs.
const GRAY: u64 = 8;

/// A farm over two GPUs (a server on each) with the server on GPU 1 SIGKILLed mid-run: its
/// producers redo their inputs through the other server while it restarts, and every input gets
/// exactly one line.
pub(crate) fn farm_two_gpus_server_killed() {
    if !two_gpus() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("r.jsonl");
    let sock = dir.path().join("f.sock");
    let inputs = 20_000u64;
    let mut child = std::process::Command::new(tensorport_exe())
        .args([
            "--log",
            "warn",
            "farm",
            "--devices",
            "0,1",
            "--ready",
            "-p",
            "8",
        ])
        .args(["--synthetic", &inputs.to_string(), "--progress", "never"])
        .arg("--socket")
        .arg(&sock)
        .arg("--output")
        .arg(&out)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_lines(&mut child, &out, 2000, 120);
    // The server on GPU 1 listens on f-1.sock.
    let victim = *pids_whose_command_line(|c| c.contains("\0serve\0") && c.contains("f-1.sock"))
        .first()
        .expect("the server on GPU 1");
    let before = lines_in(&out);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(victim),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let o = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "farm failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let mut seen = std::collections::HashSet::new();
    let text = std::fs::read_to_string(&out).unwrap();
    for l in text.lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        assert!(v.get("error").is_none(), "{l}");
        assert!(
            seen.insert(v["index"].as_u64().unwrap()),
            "an input answered twice"
        );
    }
    assert_eq!(seen.len() as u64, inputs, "every input once");
    assert!(stdout.contains("server restarts 1"), "{stdout}");
    println!(
        "  {inputs} inputs over two GPUs, the server on GPU 1 SIGKILLed after {before} results: {} lines, {} distinct",
        text.lines().count(),
        seen.len()
    );
}

/// A farm whose producers decode on the GPU (and one on the CPU) over JPEGs (grayscale ones
/// among them), PNGs and a broken file: every input gets exactly one line, the GPU producers did
/// most of them, the broken file an error, and the scores agree with a CPU-producer farm's.
pub(crate) fn farm_gpu_producers() {
    let dir = tempfile::tempdir().unwrap();
    let (all, _) = sample_images(dir.path(), 96);
    std::fs::write(
        std::path::Path::new(&all).join("zz-broken.jpg"),
        b"\xff\xd8\xff\xe0 not a JPEG",
    )
    .unwrap();
    // Grayscale JPEGs (one component): nvJPEG's batched decode into RGB planes does not give
    // them right, so they must reach the CPU path and score as the CPU producers' farm does.
    for k in 0..GRAY {
        let rgb = tensorport_vision::synthetic(5000 + k, 160 + 16 * k as u32, 120);
        image::DynamicImage::ImageRgb8(rgb)
            .to_luma8()
            .save(std::path::Path::new(&all).join(format!("gray-{k}.jpg")))
            .unwrap();
    }
    let run = |extra: &[&str], out: &str| {
        let mut args = vec![
            "farm",
            "--device",
            "cuda",
            "--input",
            &all,
            "--progress",
            "never",
            "--output",
            out,
        ];
        args.extend_from_slice(extra);
        let said = tp(&args);
        println!(
            "  farm {extra:?}: {}",
            said.lines()
                .find(|l| l.contains("throughput"))
                .unwrap_or("")
                .trim()
        );
        let mut lines = std::collections::BTreeMap::new();
        for l in std::fs::read_to_string(out).unwrap().lines() {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let prev = lines.insert(v["index"].as_u64().unwrap(), v);
            assert!(prev.is_none(), "an input answered twice");
        }
        lines
    };
    let g = dir.path().join("g.jsonl");
    let c = dir.path().join("c.jsonl");
    let gpu = run(
        &["--gpu-producers", "2", "--producers", "1"],
        g.to_str().unwrap(),
    );
    let cpu = run(&["--producers", "2"], c.to_str().unwrap());
    let total = 97 + GRAY as usize;
    assert_eq!(gpu.len(), total);
    assert_eq!(cpu.len(), total);
    // u8 planes from the GPU producers, normalised by the server: the same scores.
    let u = dir.path().join("u.jsonl");
    let gpu_u8 = run(
        &["--gpu-producers", "2", "--producers", "0", "--pixels", "u8"],
        u.to_str().unwrap(),
    );
    assert_eq!(gpu_u8.len(), total);
    let mut u8_worst = 0f64;
    // Inputs a GPU producer prepared in both runs (in the first, the CPU producer took some).
    let by_gpu_both = |i: &u64| gpu[i]["producer"].as_str().unwrap().starts_with("gpu-");
    for (i, v) in gpu_u8.iter().filter(|(i, _)| by_gpu_both(i)) {
        let (Some(a), Some(b)) = (v["scores"].as_array(), gpu[i]["scores"].as_array()) else {
            assert!(v["error"].is_string() && gpu[i]["error"].is_string(), "{v}");
            continue;
        };
        for (a, b) in a.iter().zip(b) {
            let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
            u8_worst = u8_worst.max((a - b).abs() / (1.0 + b.abs()));
        }
    }
    println!(
        "  --pixels u8 from the GPU producers: largest relative score difference from f32 {u8_worst:.2e} over the {} inputs GPU producers prepared in both runs",
        gpu.keys().filter(|i| by_gpu_both(i)).count()
    );
    assert!(u8_worst <= 1e-4, "{u8_worst}");
    let by_gpu = gpu
        .values()
        .filter(|v| v["producer"].as_str().unwrap().starts_with("gpu-"))
        .count();
    let (mut same, mut worst, mut errors, mut gray_worst) = (0, 0f64, 0, 0f64);
    for (i, v) in &gpu {
        let w = &cpu[i];
        assert_eq!(v["input"], w["input"]);
        if v["input"].as_str().unwrap().ends_with("zz-broken.jpg") {
            assert!(
                v["error"].is_string() && w["error"].is_string(),
                "{v} / {w}"
            );
            errors += 1;
            continue;
        }
        assert!(v["error"].is_null(), "{v}");
        same += (v["class"] == w["class"]) as usize;
        for (a, b) in v["scores"]
            .as_array()
            .unwrap()
            .iter()
            .zip(w["scores"].as_array().unwrap())
        {
            let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
            worst = worst.max((a - b).abs() / (1.0 + b.abs()));
            if v["input"].as_str().unwrap().contains("/gray-") {
                gray_worst = gray_worst.max((a - b).abs() / (1.0 + b.abs()));
            }
        }
    }
    let good = total - 1;
    println!("  {total} inputs once each; {by_gpu} by GPU producers; same class as the CPU producers' farm {same}/{good}; largest relative score difference {worst:.3} ({GRAY} grayscale JPEGs: {gray_worst:.2e}); broken file: an error line");
    assert_eq!(errors, 1);
    assert!(by_gpu >= 24, "the GPU producers did only {by_gpu}");
    assert!(same + 10 >= good, "only {same}/{good} classes agree");
    assert!(
        gray_worst <= 1e-4,
        "grayscale JPEGs' scores differ by {gray_worst}"
    );
    assert!(worst <= 0.1, "scores differ by {worst}");
}

/// A farm of the CUDA model with GPU producers sharing the GPU through a private MPS daemon
/// (`--mps on`), whose MPS server is SIGKILLed mid-run — what a fatal GPU fault in one client
/// does to every client of that server: the GPU processes fail and are restarted (the control
/// daemon starts a new MPS server for them), and every input still has exactly one line, none an
/// error. Skipped where `nvidia-cuda-mps-control` is not on PATH.
pub(crate) fn farm_under_mps_server_killed() {
    farm_under_mps_with_a_fault(MpsFault::KillServer);
}

/// The same farm under its private MPS daemon, joined mid-run by another client of its MPS server
/// (`tensorport-dev gpu fault`) that launches a kernel writing out of bounds — a real fatal GPU
/// fault in a process sharing the server: every input still has exactly one line, none an error.
pub(crate) fn farm_under_mps_client_fault() {
    farm_under_mps_with_a_fault(MpsFault::OutOfBoundsKernel);
}

enum MpsFault {
    KillServer,
    OutOfBoundsKernel,
}

/// Pids of the processes whose command line (arguments joined by NUL) satisfies `pred`.
fn pids_whose_command_line(pred: impl Fn(&str) -> bool) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| pred(&String::from_utf8_lossy(&c)))
        })
        .collect()
}

fn mps_servers() -> Vec<i32> {
    pids_whose_command_line(|c| c.contains("nvidia-cuda-mps-server"))
}

/// Lines in the file at `out` (none while it is not there).
fn lines_in(out: &std::path::Path) -> usize {
    std::fs::read_to_string(out)
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

/// Waits until the farm has written `n` lines to `out`, failing the test after `secs`.
fn wait_for_lines(farm: &mut std::process::Child, out: &std::path::Path, n: usize, secs: u64) {
    let t = std::time::Instant::now();
    while lines_in(out) < n {
        // A farm that ended (refusing its options, say) will write no more: say why at once.
        if let Ok(Some(status)) = farm.try_wait() {
            let mut said = String::new();
            if let Some(mut e) = farm.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut e, &mut said);
            }
            panic!(
                "the farm ended ({status}) after {} of the {n} results waited for:\n{said}",
                lines_in(out)
            );
        }
        assert!(
            t.elapsed().as_secs() < secs,
            "the farm wrote no {n} results in {secs} s"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// `CUDA_MPS_PIPE_DIRECTORY` in the environment of process `pid`.
fn pipe_directory_of(pid: i32) -> Option<String> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    env.split(|b| *b == 0).find_map(|kv| {
        let kv = String::from_utf8_lossy(kv);
        kv.strip_prefix("CUDA_MPS_PIPE_DIRECTORY=")
            .map(str::to_string)
    })
}

fn farm_under_mps_with_a_fault(fault: MpsFault) {
    if tensorport_farm::mps::Tools::find().control.is_none() {
        println!("  skipped: nvidia-cuda-mps-control is not on PATH");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (_, jpegs) = sample_images(dir.path(), 96);
    let mut files: Vec<String> = std::fs::read_dir(&jpegs)
        .unwrap()
        .map(|e| e.unwrap().path().display().to_string())
        .collect();
    files.sort();
    let list = dir.path().join("list");
    let repeat = 60;
    let listed: String = (0..repeat)
        .flat_map(|_| files.iter())
        .map(|f| format!("{f}\n"))
        .collect();
    std::fs::write(&list, listed).unwrap();
    let inputs = (files.len() * repeat) as u64;
    let out = dir.path().join("r.jsonl");
    let mut child = std::process::Command::new(tensorport_exe())
        .args(["farm", "--device", "cuda", "--mps", "on"])
        .args(["-p", "2", "--gpu-producers", "2", "--progress", "never"])
        .arg("--input-list")
        .arg(&list)
        .arg("--output")
        .arg(&out)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_lines(&mut child, &out, 500, 180);
    let servers = mps_servers();
    assert!(!servers.is_empty(), "no MPS server runs under the farm");
    let before = lines_in(&out);
    let what = match fault {
        MpsFault::KillServer => {
            for pid in &servers {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(*pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            "its server SIGKILLed".to_string()
        }
        MpsFault::OutOfBoundsKernel => {
            let pipe = servers
                .iter()
                .find_map(|pid| pipe_directory_of(*pid))
                .expect("the MPS server's pipe directory");
            let dev = std::path::Path::new(&tensorport_exe()).with_file_name("tensorport-dev");
            let faulted = std::process::Command::new(&dev)
                .args(["gpu", "fault"])
                .env("CUDA_MPS_PIPE_DIRECTORY", &pipe)
                .output()
                .unwrap();
            let said = String::from_utf8_lossy(&faulted.stdout).to_string()
                + &String::from_utf8_lossy(&faulted.stderr);
            assert!(
                faulted.status.success(),
                "the faulting client did not see its fault: {said}"
            );
            format!("a client's out-of-bounds kernel ({})", said.trim())
        }
    };
    let o = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "farm failed:\n{stdout}\n{stderr}");
    assert!(stderr.contains("private MPS daemon"), "{stderr}");
    let mut seen = std::collections::HashSet::new();
    let text = std::fs::read_to_string(&out).unwrap();
    let mut errors = 0;
    for l in text.lines() {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        errors += usize::from(v.get("error").is_some());
        assert!(
            seen.insert(v["index"].as_u64().unwrap()),
            "an input answered twice"
        );
    }
    assert_eq!(seen.len() as u64, inputs, "every input once");
    assert_eq!(errors, 0, "error lines after the fault:\n{text}");
    let restarts = stderr.lines().filter(|l| l.contains("restart")).count();
    println!(
        "  {inputs} inputs under a private MPS daemon, {what} after {before} results: {} lines, {} distinct, no errors; {restarts} restart lines",
        text.lines().count(),
        seen.len()
    );
}
