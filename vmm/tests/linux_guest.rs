//! Real Linux guests: Twig's guest kernel (guest/build-kernel.sh) with a
//! busybox initramfs that prints a tick a second, each with 16 bytes it read
//! from /dev/hwrng (twig-vmm's virtio-rng device). These need a KVM that runs
//! guest ring 0, so they are built with `--features lab` and run inside the
//! nested lab (tests/lab/run.sh), which provides the kernel and initramfs.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::*;
use twig_vmm::{Capture, Kind, RunState, Shape, Vm};

const BOOT: Duration = Duration::from_secs(120);
const CMDLINE: &str = "console=ttyS0 earlyprintk=ttyS0 reboot=k panic=-1";

fn guest() -> (PathBuf, PathBuf) {
    let var =
        |name: &str| -> PathBuf {
            std::env::var_os(name).map(PathBuf::from).unwrap_or_else(|| {
            panic!("{name} is not set: this test runs inside the nested lab (tests/lab/run.sh)")
        })
        };
    (var("TWIG_GUEST_KERNEL"), var("TWIG_GUEST_INITRD"))
}

fn boot_linux() -> (Vm, Capture) {
    require_kvm();
    let (kernel, initrd) = guest();
    let serial = Capture::new();
    let mut vm = Vm::create(Shape::new(128, 1), serial.writer()).unwrap();
    vm.boot_linux(&kernel, Some(&initrd), CMDLINE).unwrap();
    serial.wait_for(b"TWIG-GUEST-READY", 0, BOOT).unwrap();
    (vm, serial)
}

/// The "tick N <random hex>" lines printed so far, as (N, hex).
fn ticks(serial: &Capture) -> Vec<(u64, String)> {
    String::from_utf8_lossy(&serial.bytes())
        .lines()
        .filter_map(|l| {
            let mut parts = l.trim().strip_prefix("tick ")?.split_whitespace();
            let n = parts.next()?.parse().ok()?;
            Some((n, parts.next().unwrap_or_default().to_string()))
        })
        .collect()
}

/// The last tick printed so far.
fn last_tick(serial: &Capture) -> u64 {
    ticks(serial).last().map_or(0, |t| t.0)
}

/// Waits for tick `n` (from byte `from`) and returns its random hex.
fn wait_tick(serial: &Capture, n: u64, from: usize) -> String {
    let pat = format!("tick {n} ");
    let at = serial.wait_for(pat.as_bytes(), from, BOOT).unwrap();
    serial.wait_for(b"\n", at, BOOT).unwrap();
    let hex = ticks(serial)
        .into_iter()
        .rev()
        .find(|t| t.0 == n)
        .map(|t| t.1)
        .unwrap_or_default();
    assert_eq!(
        hex.len(),
        32,
        "16 bytes from /dev/hwrng on tick {n}: {hex:?}; serial:\n{}",
        String::from_utf8_lossy(&serial.bytes())
    );
    hex
}

#[test]
fn linux_boots_snapshots_restores_and_rolls_back() {
    let d = tmp();
    let (mut vm, serial) = boot_linux();
    wait_tick(&serial, 2, 0);
    vm.pause().unwrap();
    let at = last_tick(&serial);
    let s = snap(d.path(), "s");
    take(&mut vm, &s, Kind::Full).unwrap();

    // A new VM restored from the snapshot carries on from the same tick.
    let rserial = Capture::new();
    let mut r = Vm::create(Shape::new(128, 1), rserial.writer()).unwrap();
    r.restore(&s).unwrap();
    wait_tick(&rserial, at + 1, 0);
    assert!(
        !String::from_utf8_lossy(&rserial.bytes()).contains("TWIG-GUEST-READY"),
        "the restored guest did not boot again"
    );

    // The original runs on, then rolls back: its ticks rewind.
    vm.resume().unwrap();
    wait_tick(&serial, at + 3, 0);
    let mark = serial.bytes().len();
    vm.rollback(&s).unwrap();
    assert_eq!(vm.state(), RunState::Running);
    wait_tick(&serial, at + 1, mark);
}

#[test]
fn linux_clones_run_side_by_side() {
    let d = tmp();
    let (mut vm, serial) = boot_linux();
    wait_tick(&serial, 1, 0);
    vm.pause().unwrap();
    let at = last_tick(&serial);
    let s = snap(d.path(), "s");
    take(&mut vm, &s, Kind::Full).unwrap();
    let captures: Vec<Capture> = (0..3).map(|_| Capture::new()).collect();
    let clones = Vm::clone_from(&s, 3, |i| captures[i].writer(), |_| Default::default()).unwrap();
    // Every clone carries on from the same tick, and its virtio-rng draws
    // its own entropy. The first read after the restore may still be served
    // from bytes the guest's hwrng layers had buffered before the snapshot
    // (shared by every clone until the agent reseeds), so compare the next
    // tick's bytes, which come from each clone's own device.
    for c in &captures {
        wait_tick(c, at + 1, 0);
    }
    let mut seen: Vec<String> = captures.iter().map(|c| wait_tick(c, at + 2, 0)).collect();
    assert_eq!(clones.len(), 3);
    seen.sort();
    seen.dedup();
    assert_eq!(seen.len(), 3, "clones shared RNG output: {seen:?}");
}
