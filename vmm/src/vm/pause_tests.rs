//! A pause that times out is withdrawn: the VM is never left frozen while
//! reported running. The vCPU is held in host I/O on its own thread by a
//! serial output that does not take bytes (as a disk flush or a full pipe
//! would hold it).

use std::io::Write;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, ErrorKind};
use crate::testguest::{self, Command};
use crate::vcpu::PARK_TIMEOUT;
use crate::vm::{RunState, Shape, Vm};

const T: Duration = Duration::from_secs(20);

/// A serial output that blocks its writer while closed.
#[derive(Clone, Default)]
struct Gate(Arc<(Mutex<GateState>, Condvar)>);

#[derive(Default)]
struct GateState {
    closed: bool,
    /// Writers blocked right now.
    held: usize,
}

impl Gate {
    fn set(&self, closed: bool) {
        self.0 .0.lock().unwrap().closed = closed;
        self.0 .1.notify_all();
    }

    fn held(&self) -> usize {
        self.0 .0.lock().unwrap().held
    }
}

impl Write for Gate {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        let mut s = self.0 .0.lock().unwrap();
        s.held += 1;
        while s.closed {
            s = self.0 .1.wait(s).unwrap();
        }
        s.held -= 1;
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn counter(vm: &Vm) -> u64 {
    vm.read_u64(testguest::COUNTER)
        .expect("reading the counter")
}

#[test]
fn a_pause_that_times_out_is_withdrawn_and_the_vm_runs_on() {
    if let Err(e) = crate::vm::open_kvm() {
        panic!("this test needs a usable /dev/kvm (run as root on a KVM host): {e}");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let gate = Gate::default();
    let mut vm = Vm::create(Shape::new(32, 1), Box::new(gate.clone())).expect("create");
    let kernel = testguest::write_to(dir.path()).expect("writing the test guest");
    vm.boot(&kernel, "console=ttyS0").expect("boot");
    testguest::wait_booted(&vm, T).expect("guest magic");

    // The guest prints; its vCPU blocks in the serial write.
    gate.set(true);
    let printed = testguest::post(&mut vm, Command::Print, [u64::from(b'p'), 0, 0]).unwrap();
    testguest::poll(T, "the vCPU to block in the serial write", || {
        Ok(gate.held() == 1)
    })
    .unwrap();
    let start = Instant::now();
    let e = vm.pause().expect_err("the vCPU cannot park");
    let took = start.elapsed();
    assert!(
        took >= PARK_TIMEOUT && took < PARK_TIMEOUT + Duration::from_secs(2),
        "{took:?}"
    );
    assert!(matches!(e, Error::PauseTimedOut { .. }), "{e}");
    assert_eq!(e.kind(), ErrorKind::Refused, "the VM still runs: {e}");
    assert!(e.to_string().contains("vCPU 0 did not pause"), "{e}");
    assert_eq!(vm.state(), RunState::Running);

    // Released, the vCPU finishes its write and runs on: no pause request
    // was left behind to freeze it.
    gate.set(false);
    testguest::poll(T, "the print to complete", || {
        Ok(vm.read_u64(testguest::DONE)? >= printed)
    })
    .unwrap();
    testguest::post(&mut vm, Command::Spin, [0; 3]).unwrap();
    testguest::poll(T, "the counter to advance", || Ok(counter(&vm) > 1000)).unwrap();

    // A later pause succeeds and holds.
    vm.pause().expect("pause once the vCPU is free");
    assert_eq!(vm.state(), RunState::Paused);
    let held = counter(&vm);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(counter(&vm), held, "a paused guest does not run");
    vm.resume().unwrap();
    testguest::poll(
        T,
        "the counter to advance again",
        || Ok(counter(&vm) > held),
    )
    .unwrap();
}
