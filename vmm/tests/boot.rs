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
fn boots_a_bzimage_with_its_setup_header() {
    require_kvm();
    let d = tmp();
    let serial = twig_vmm::Capture::new();
    let mut vm = Vm::create(Shape::new(MIB, 1), serial.writer()).unwrap();
    let kernel = testguest::write_image(d.path(), "bzImage", testguest::BZIMAGE).unwrap();
    vm.boot(&kernel, "console=ttyS0 quiet").unwrap();
    serial.wait_for(b"B", 0, T).unwrap();
    testguest::wait_booted(&vm, T).unwrap();
    // boot_params (at the VMM's zero page, 0x7000) carries the image's
    // setup header and our command line.
    let zero_page = 0x7000;
    let mut hdr = [0u8; 4];
    vm.read_guest(zero_page + 0x202, &mut hdr).unwrap();
    assert_eq!(&hdr, b"HdrS");
    // The command line (at hdr.cmd_line_ptr), with the virtio-mmio devices
    // announced.
    let mut ptr = [0u8; 4];
    vm.read_guest(zero_page + 0x228, &mut ptr).unwrap();
    let mut cmdline = [0u8; 128];
    vm.read_guest(u32::from_le_bytes(ptr).into(), &mut cmdline)
        .unwrap();
    let end = cmdline.iter().position(|b| *b == 0).unwrap();
    assert_eq!(
        std::str::from_utf8(&cmdline[..end]).unwrap(),
        "console=ttyS0 quiet virtio_mmio.device=4K@0xd0000000:5"
    );
    let mut g = Guest { vm, serial };
    print(&mut g.vm, &g.serial, b'z');
}

#[test]
fn pause_stops_the_guest_and_resume_continues() {
    let d = tmp();
    let mut g = boot(d.path(), MIB, 2);
    testguest::post(&mut g.vm, Command::Spin, [0; 3]).unwrap();
    testguest::poll(T, "spinning", || {
        Ok(g.vm.read_u64(testguest::COUNTER)? > 1000)
    })
    .unwrap();
    g.vm.pause().unwrap();
    let a = g.vm.read_u64(testguest::COUNTER).unwrap();
    std::thread::yield_now();
    let b = g.vm.read_u64(testguest::COUNTER).unwrap();
    assert_eq!(a, b, "a paused guest does not run");
    g.vm.resume().unwrap();
    testguest::poll(T, "counter to move", || {
        Ok(g.vm.read_u64(testguest::COUNTER)? > b)
    })
    .unwrap();
}

#[test]
fn guest_reset_and_crash_stop_the_vm() {
    let d = tmp();
    let mut g = boot(d.path(), MIB, 1);
    testguest::post(&mut g.vm, Command::Stop, [0; 3]).unwrap();
    assert_eq!(g.vm.wait_exit(T), Some(GuestExit::Reset));
    assert_eq!(g.vm.state(), RunState::Stopped);
    let err = take(&mut g.vm, &snap(d.path(), "s"), twig_vmm::Kind::Full).unwrap_err();
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
    assert!(
        err.contains("neither an ELF vmlinux") && err.contains("bzImage"),
        "{err}"
    );
    let err = vm
        .boot(&d.path().join("missing"), "")
        .unwrap_err()
        .to_string();
    assert!(err.contains("No such file"), "{err}");
    for (mib, vcpus) in [(1, 1), (MIB, 0), (MIB, 1000), (4096, 1)] {
        let r = Vm::create(Shape::new(mib, vcpus), Box::new(std::io::sink()));
        assert!(r.is_err(), "shape {mib} MiB x {vcpus} accepted");
    }
}

#[test]
fn vcpus_get_consistent_cpuid_but_their_own_apic_ids() {
    let d = tmp();
    let mut g = boot(d.path(), MIB, 3);
    let s = snap(d.path(), "s");
    take(&mut g.vm, &s, twig_vmm::Kind::Full).unwrap();
    let state = twig_vmm::snapshot::read_state(&s).unwrap();
    // CPUID as each vCPU got it, with the per-vCPU APIC ids masked out.
    let stripped: Vec<Vec<[u32; 6]>> = state
        .vcpus
        .iter()
        .map(|v| {
            v.cpuid
                .iter()
                .map(|e| {
                    let mut r = [e.function, e.index, e.eax, e.ebx, e.ecx, e.edx];
                    match e.function {
                        1 => r[3] &= 0x00ff_ffff,
                        0xb | 0x1f => r[5] = 0,
                        _ => {}
                    }
                    r
                })
                .collect()
        })
        .collect();
    for (i, v) in state.vcpus.iter().enumerate() {
        assert_eq!(stripped[i], stripped[0], "vCPU {i} CPUID differs");
        let apic = v
            .cpuid
            .iter()
            .find(|e| e.function == 1)
            .map(|e| e.ebx >> 24);
        assert_eq!(apic, Some(i as u32), "vCPU {i} APIC id");
    }
}

/// A guest spamming COM1 (for as long as it likes: the bound does not
/// depend on time) leaves the console and its previous part under their
/// bound, holding the newest bytes.
#[test]
fn a_guest_spamming_com1_leaves_the_console_under_its_bound() {
    require_kvm();
    const MAX: u64 = 2048;
    const TIMES: u64 = 1 << 40;
    let d = tmp();
    let path = d.path().join("serial.log");
    let previous = d.path().join("serial.log.1");
    let out = twig_vmm::console::BoundedFile::open(&path, MAX).unwrap();
    let mut vm = Vm::create(Shape::new(MIB, 1), Box::new(out)).unwrap();
    let kernel = testguest::write_to(d.path()).unwrap();
    vm.boot(&kernel, "console=ttyS0").unwrap();
    testguest::wait_booted(&vm, T).unwrap();
    testguest::post(&mut vm, Command::Print, [u64::from(b'#'), TIMES, 0]).unwrap();
    let size = |p: &std::path::Path| std::fs::metadata(p).map_or(0, |m| m.len());
    // Until the guest has printed several times the bound (polled: the
    // lab's emulated CPUs print far slower than the host's), the files
    // stay under it.
    let deadline = std::time::Instant::now() + T;
    loop {
        assert!(size(&path) <= MAX && size(&previous) <= MAX);
        vm.pause().unwrap();
        let printed = TIMES - vm.vcpu_regs(0).unwrap().rcx;
        let newest_only = || {
            let old = std::fs::read(&previous).unwrap_or_default();
            let now = std::fs::read(&path).unwrap_or_default();
            old.len() as u64 == MAX && old.iter().chain(&now).all(|b| *b == b'#')
        };
        if printed > 4 * MAX && newest_only() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the guest printed only {printed} bytes within {T:?}, or the files do not hold \
             only the newest output"
        );
        vm.resume().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(size(&path) <= MAX, "{}", size(&path));
    let old = std::fs::read(&previous).unwrap();
    assert_eq!(old.len() as u64, MAX, "rotated, the previous part full");
    let now = std::fs::read(&path).unwrap();
    assert!(
        old.iter().chain(&now).all(|b| *b == b'#'),
        "only the newest output, the boot marker long gone"
    );
}
