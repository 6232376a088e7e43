//! Boot, serial output, pause/resume and guest-initiated stops on /dev/kvm.

mod common;

use common::*;
use twig_vmm::testguest::{self, Command};
use twig_vmm::{GuestExit, RunState, Shape, Vm};

#[test]
fn boots_prints_and_runs_commands() {
    let d = tmp();
    let mut g = boot(d.path(), MIB, 1);
    print(&mut g.vm, &g.serial, b'x');
    dirty(&mut g.vm, 0, 10, 100);
    assert_eq!(word(&g.vm, 0), 100);
    assert_eq!(word(&g.vm, 9), 109);
    assert_eq!(g.vm.state(), RunState::Running);
}

#[test]
fn pause_stops_the_guest_and_resume_continues() {
    let d = tmp();
    let mut g = boot(d.path(), MIB, 2);
    testguest::post(&mut g.vm, Command::Spin, [0; 3]).unwrap();
    testguest::poll(T, "spinning", || Ok(g.vm.read_u64(testguest::COUNTER)? > 1000)).unwrap();
    g.vm.pause().unwrap();
    let a = g.vm.read_u64(testguest::COUNTER).unwrap();
    std::thread::yield_now();
    let b = g.vm.read_u64(testguest::COUNTER).unwrap();
    assert_eq!(a, b, "a paused guest does not run");
    g.vm.resume().unwrap();
    testguest::poll(T, "counter to move", || Ok(g.vm.read_u64(testguest::COUNTER)? > b)).unwrap();
}

#[test]
fn guest_reset_and_crash_stop_the_vm() {
    let d = tmp();
    let mut g = boot(d.path(), MIB, 1);
    testguest::post(&mut g.vm, Command::Stop, [0; 3]).unwrap();
    assert_eq!(g.vm.wait_exit(T), Some(GuestExit::Reset));
    assert_eq!(g.vm.state(), RunState::Stopped);
    let err = g.vm.snapshot(&d.path().join("s"), twig_vmm::Kind::Full).unwrap_err();
    assert!(err.to_string().contains("stopped"), "{err}");

    let mut g = boot(d.path(), MIB, 1);
    testguest::post(&mut g.vm, Command::Crash, [0; 3]).unwrap();
    assert_eq!(g.vm.wait_exit(T), Some(GuestExit::TripleFault));
}

#[test]
fn bad_kernels_and_shapes_are_refused() {
    require_kvm();
    let d = tmp();
    let junk = d.path().join("junk");
    std::fs::write(&junk, vec![0x5au8; 8192]).unwrap();
    let mut vm = Vm::create(Shape::new(MIB, 1), Box::new(std::io::sink())).unwrap();
    let err = vm.boot(&junk, "").unwrap_err().to_string();
    assert!(err.contains("neither an ELF vmlinux") && err.contains("bzImage"), "{err}");
    let err = vm.boot(&d.path().join("missing"), "").unwrap_err().to_string();
    assert!(err.contains("No such file"), "{err}");
    for (mib, vcpus) in [(1, 1), (MIB, 0), (MIB, 1000), (4096, 1)] {
        let r = Vm::create(Shape::new(mib, vcpus), Box::new(std::io::sink()));
        assert!(r.is_err(), "shape {mib} MiB x {vcpus} accepted");
    }
}
