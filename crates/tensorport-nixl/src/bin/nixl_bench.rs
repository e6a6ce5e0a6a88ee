//! Two processes, one NIXL read path: `hold` registers slots of host memory and prints what a
//! reader needs on one line; `read` takes that line on standard input, reads the slots over and
//! over with several transfers in flight, checks every byte of the first round, and prints the
//! rate. `--gpu N` puts either side's slots on a GPU. `UCX_TLS=tcp` forces UCX's TCP transport
//! (over loopback on one host; `tcp,cuda_copy` where NVIDIA GPUs are present).
//!
//! ```sh
//! nixl-bench hold --slots 64 --slot-len 602112 | nixl-bench read --seconds 3 --in-flight 16
//! ```
//! (`hold` ends when its standard input closes or `read` says `done` on it; in the pipe above it
//! ends with the reader, when its output pipe breaks.)

use std::io::{BufRead, Write};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tensorport_cuda::Gpu;
use tensorport_nixl::{Agent, Capi, Memory, Reader, Region, SlotLayout};

const USAGE: &str = "usage:
  nixl-bench hold [--slots N] [--slot-len BYTES] [--name NAME] [--gpu ORDINAL]
                  [--ucx-param KEY=VALUE]...
      register N slots (64) of BYTES (602112: a [3,224,224] f32 tensor), in host memory or on
      the GPU, fill slot i with its pattern, print `NAME BASE SLOT_LEN SLOTS METADATA_HEX
      MEMORY`, and wait for standard input to end
  nixl-bench read [--seconds S] [--in-flight K] [--name NAME] [--gpu ORDINAL]
                  [--op read|write] [--ucx-param KEY=VALUE]...
      read the line `hold` printed from standard input; read its slots for S seconds (3), K
      transfers in flight (16), into host memory or the GPU's; check the first round's bytes;
      print the rate. With --op write, write K local slots into the holder's instead (UCX may
      choose another protocol for writes than for reads); the holder's bytes are not checked
The NIXL library: scripts/fetch-nixl.sh, or TENSORPORT_NIXL.";

/// Slot `i`'s byte at `k`.
fn pattern(i: u32, k: usize) -> u8 {
    (i as usize * 31 + k * 7 % 251) as u8
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

struct Opts {
    slots: u32,
    slot_len: u64,
    seconds: f64,
    in_flight: u32,
    name: Option<String>,
    gpu: Option<u32>,
    /// Write into the holder's slots instead of reading them.
    write: bool,
    /// Parameters of NIXL's UCX backend.
    params: Vec<(String, String)>,
}

impl Opts {
    fn ucx_params(&self) -> Vec<(&str, &str)> {
        self.params
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect()
    }
}

fn parse(args: &[String]) -> Result<Opts, String> {
    let mut o = Opts {
        slots: 64,
        slot_len: 602_112,
        seconds: 3.0,
        in_flight: 16,
        name: None,
        gpu: None,
        write: false,
        params: Vec::new(),
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let v = it.next().ok_or(format!("{flag} needs a value"))?;
        let bad = || format!("{flag}: not a number: {v}");
        match flag.as_str() {
            "--slots" => o.slots = v.parse().map_err(|_| bad())?,
            "--slot-len" => o.slot_len = v.parse().map_err(|_| bad())?,
            "--seconds" => o.seconds = v.parse().map_err(|_| bad())?,
            "--in-flight" => o.in_flight = v.parse().map_err(|_| bad())?,
            "--name" => o.name = Some(v.clone()),
            "--gpu" => o.gpu = Some(v.parse().map_err(|_| bad())?),
            "--op" => {
                o.write = match v.as_str() {
                    "read" => false,
                    "write" => true,
                    _ => return Err(format!("{flag}: expected read or write, not {v}")),
                }
            }
            "--ucx-param" => {
                let (k, val) = v
                    .split_once('=')
                    .ok_or(format!("{flag}: not KEY=VALUE: {v}"))?;
                o.params.push((k.to_string(), val.to_string()));
            }
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    Ok(o)
}

/// `slots` slots of `len` bytes, in host memory or on GPU `gpu`.
fn register(agent: &Agent, gpu: Option<u32>, slots: u32, len: u64) -> Result<Region, String> {
    match gpu {
        None => agent.register(slots, len),
        Some(n) => {
            let gpu = Gpu::open(n as i32).map_err(|e| format!("GPU {n}: {e}"))?;
            agent.register_device(&gpu, slots, len)
        }
    }
    .map_err(|e| e.to_string())
}

fn hold(o: &Opts) -> Result<(), String> {
    let capi = Arc::new(Capi::load().map_err(|e| e.to_string())?);
    let name = o.name.clone().unwrap_or_else(|| "holder".into());
    let agent = Agent::with_params(&capi, &name, &o.ucx_params()).map_err(|e| e.to_string())?;
    let mut region = register(&agent, o.gpu, o.slots, o.slot_len)?;
    for i in 0..o.slots {
        let bytes: Vec<u8> = (0..o.slot_len as usize).map(|k| pattern(i, k)).collect();
        match region.slot_mut(i) {
            Some(s) => s.copy_from_slice(&bytes),
            None => region.upload(i, &bytes).map_err(|e| e.to_string())?,
        }
    }
    let md = agent.metadata().map_err(|e| e.to_string())?;
    let l = region.layout();
    let mut out = std::io::stdout();
    writeln!(
        out,
        "{name} {} {} {} {} {}",
        l.base,
        l.slot_len,
        l.slots,
        hex(&md),
        match l.memory {
            Memory::Host => "host".to_string(),
            Memory::Device(n) => n.to_string(),
        }
    )
    .and_then(|()| out.flush())
    .map_err(|e| format!("stdout: {e}"))?;
    // Serve reads until told to stop (or the other side is gone).
    for line in std::io::stdin().lock().lines() {
        if line.map_or(true, |l| l.trim() == "done") {
            break;
        }
    }
    Ok(())
}

fn read(o: &Opts) -> Result<(), String> {
    let mut line = String::new();
    std::io::stdin()
        .read_line(&mut line)
        .map_err(|e| format!("stdin: {e}"))?;
    let f: Vec<&str> = line.split_whitespace().collect();
    let [peer_name, base, slot_len, slots, md, memory] = f[..] else {
        return Err(
            "standard input: expected `NAME BASE SLOT_LEN SLOTS METADATA_HEX MEMORY`".into(),
        );
    };
    let num = |s: &str| s.parse::<u64>().map_err(|_| format!("not a number: {s}"));
    let layout = SlotLayout {
        base: num(base)?,
        slot_len: num(slot_len)?,
        slots: u32::try_from(num(slots)?).map_err(|_| "too many slots")?,
        memory: match memory {
            "host" => Memory::Host,
            n => Memory::Device(num(n)? as u32),
        },
    };
    let md = unhex(md).ok_or("the metadata is not hex")?;
    let capi = Arc::new(Capi::load().map_err(|e| e.to_string())?);
    let agent = Agent::with_params(
        &capi,
        o.name.as_deref().unwrap_or("reader"),
        &o.ucx_params(),
    )
    .map_err(|e| e.to_string())?;
    let peer = agent
        .add_peer(&md, peer_name, layout)
        .map_err(|e| e.to_string())?;
    let k = o.in_flight.clamp(1, layout.slots);
    let region = register(&agent, o.gpu, k, layout.slot_len)?;
    let mut reader = Reader::new(region, peer).map_err(|e| e.to_string())?;
    let timeout = Duration::from_secs(10);
    if o.write {
        reader.write_instead().map_err(|e| e.to_string())?;
    }
    // First round: every slot once, each checked byte for byte (read back, where writing).
    let checked_slots = if o.write { 0 } else { layout.slots };
    for from in 0..checked_slots {
        let into = from % k;
        reader.start(from, into).map_err(|e| e.to_string())?;
        reader.wait(into, timeout).map_err(|e| e.to_string())?;
        let mut copy = Vec::new();
        let got = match reader.slot(into) {
            Some(bytes) => bytes,
            None => {
                copy.resize(layout.slot_len as usize, 0);
                reader
                    .download(into, &mut copy)
                    .map_err(|e| e.to_string())?;
                &copy
            }
        };
        if let Some(at) = got
            .iter()
            .enumerate()
            .position(|(b, &x)| x != pattern(from, b))
        {
            return Err(format!(
                "slot {from}: byte {at} differs from what the holder wrote"
            ));
        }
    }
    // Timed rounds: K in flight, each finished one started again on the next peer slot.
    let mut next = 0u32;
    for into in 0..k {
        reader.start(next, into).map_err(|e| e.to_string())?;
        next = (next + 1) % layout.slots;
    }
    let start = Instant::now();
    let mut done = 0u64;
    let limit = Duration::from_secs_f64(o.seconds.max(0.1));
    while start.elapsed() < limit {
        for into in 0..k {
            if reader.poll(into).map_err(|e| e.to_string())? {
                done += 1;
                reader.start(next, into).map_err(|e| e.to_string())?;
                next = (next + 1) % layout.slots;
            }
        }
    }
    let secs = start.elapsed().as_secs_f64();
    for into in 0..k {
        reader.wait(into, timeout).map_err(|e| e.to_string())?;
    }
    drop(reader);
    let (op, dir, checked) = if o.write {
        ("write", "into", 0)
    } else {
        ("read", "from", layout.slots)
    };
    println!(
        "{done} {op}s of {} B {dir} {} slots, {k} in flight: {:.0} {op}s/s, {:.2} GB/s ({checked} checked)",
        layout.slot_len,
        layout.slots,
        done as f64 / secs,
        done as f64 * layout.slot_len as f64 / secs / 1e9,
    );
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (cmd, rest) = match args.split_first() {
        Some((c, r)) if c == "hold" || c == "read" => (c.as_str(), r),
        Some((c, _)) if c == "--help" || c == "-h" => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let opts = match parse(rest) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("nixl-bench: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let r = if cmd == "hold" {
        hold(&opts)
    } else {
        read(&opts)
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nixl-bench {cmd}: {e}");
            ExitCode::FAILURE
        }
    }
}
