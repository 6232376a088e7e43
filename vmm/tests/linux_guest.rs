//! Real Linux guests: Twig's guest kernel (guest/build-kernel.sh) with a
//! busybox initramfs that prints a tick a second. These need a KVM that runs
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

/// The last "tick N" line printed so far.
fn last_tick(serial: &Capture) -> u64 {
    String::from_utf8_lossy(&serial.bytes())
        .lines()
        .filter_map(|l| l.trim().strip_prefix("tick ")?.parse().ok())
        .next_back()
        .unwrap_or(0)
}

#[test]
fn linux_boots_snapshots_restores_and_rolls_back() {
    let d = tmp();
    let (mut vm, serial) = boot_linux();
    serial.wait_for(b"tick 2\r", 0, BOOT).unwrap();
    vm.pause().unwrap();
    let at = last_tick(&serial);
    let s = d.path().join("s");
    vm.snapshot(&s, Kind::Full).unwrap();

    // A new VM restored from the snapshot carries on from the same tick.
    let rserial = Capture::new();
    let mut r = Vm::create(Shape::new(128, 1), rserial.writer()).unwrap();
    r.restore(&s).unwrap();
    let next = format!("tick {}\r", at + 1);
    rserial.wait_for(next.as_bytes(), 0, BOOT).unwrap();
    assert!(
        !String::from_utf8_lossy(&rserial.bytes()).contains("TWIG-GUEST-READY"),
        "the restored guest did not boot again"
    );

    // The original runs on, then rolls back: its ticks rewind.
    vm.resume().unwrap();
    let later = format!("tick {}\r", at + 3);
    serial.wait_for(later.as_bytes(), 0, BOOT).unwrap();
    let mark = serial.bytes().len();
    vm.rollback(&s).unwrap();
    assert_eq!(vm.state(), RunState::Running);
    serial.wait_for(next.as_bytes(), mark, BOOT).unwrap();
}

#[test]
fn linux_clones_run_side_by_side() {
    let d = tmp();
    let (mut vm, serial) = boot_linux();
    serial.wait_for(b"tick 1\r", 0, BOOT).unwrap();
    vm.pause().unwrap();
    let at = last_tick(&serial);
    let s = d.path().join("s");
    vm.snapshot(&s, Kind::Full).unwrap();
    let captures: Vec<Capture> = (0..3).map(|_| Capture::new()).collect();
    let clones = Vm::clone_from(&s, 3, |i| captures[i].writer()).unwrap();
    let next = format!("tick {}\r", at + 1);
    for c in &captures {
        c.wait_for(next.as_bytes(), 0, BOOT).unwrap();
    }
    assert_eq!(clones.len(), 3);
}
