//! virtio-rng: fills the guest's buffers from the host's `getrandom`, so
//! every VM — every clone of one snapshot included — draws its own entropy.

use virtio_bindings::virtio_ids::VIRTIO_ID_RNG;
use virtio_queue::{Queue, QueueT};
use vm_memory::Bytes;

use super::VirtioDevice;
use crate::memory::GuestMem;
use crate::ratelimit::warn_limited;

/// Largest request served at once; a guest asking for more gets this much.
const MAX_REQUEST: u32 = 64 * 1024;

/// The entropy device.
#[derive(Default)]
pub struct Rng;

fn fill_random(buf: &mut [u8]) -> bool {
    let mut done = 0;
    while done < buf.len() {
        // SAFETY: getrandom writes at most the remaining length into buf.
        let n = unsafe { libc::getrandom(buf[done..].as_mut_ptr().cast(), buf.len() - done, 0) };
        if n <= 0 {
            return false;
        }
        done += n as usize;
    }
    true
}

impl VirtioDevice for Rng {
    fn device_type(&self) -> u32 {
        VIRTIO_ID_RNG
    }

    fn features(&self) -> u64 {
        0
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &[256]
    }

    fn read_config(&self, _offset: u64, data: &mut [u8]) {
        data.iter_mut().for_each(|b| *b = 0);
    }

    fn process_queue(&mut self, index: usize, queues: &mut [Queue], mem: &GuestMem) -> bool {
        let Some(queue) = queues.get_mut(index) else {
            return false;
        };
        let mut used = false;
        while let Some(chain) = queue.pop_descriptor_chain(mem) {
            let head = chain.head_index();
            let mut written = 0u32;
            for desc in chain.writable() {
                let len = desc.len().min(MAX_REQUEST - written);
                if len == 0 {
                    break;
                }
                let mut buf = vec![0u8; len as usize];
                if !fill_random(&mut buf) || mem.write_slice(&buf, desc.addr()).is_err() {
                    break;
                }
                written += len;
            }
            if let Err(e) = queue.add_used(mem, head, written) {
                warn_limited!("virtio-rng: {e}");
                break;
            }
            used = true;
        }
        used
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::testing::Driver;

    #[test]
    fn requests_are_capped_and_readable_buffers_left_alone() {
        let mut d = Driver::new(Box::new(Rng));
        let (a, b, r) = (d.alloc(40_000), d.alloc(40_000), d.alloc(64));
        for (addr, len) in [(a, 40_000), (b, 40_000), (r, 64)] {
            d.write(addr, &vec![0xaa; len]);
        }
        let head = d.post(0, &[(r, 64, false), (a, 40_000, true), (b, 40_000, true)]);
        d.notify(0);
        assert_eq!(d.used(0), Some((u32::from(head), MAX_REQUEST)));
        let rest = MAX_REQUEST as usize - 40_000;
        let second = d.read(b, 40_000);
        assert!(d.read(a, 40_000).iter().any(|x| *x != 0xaa), "filled");
        assert!(second[..rest].iter().any(|x| *x != 0xaa), "filled");
        assert!(second[rest..].iter().all(|x| *x == 0xaa), "past the cap");
        assert_eq!(d.read(r, 64), vec![0xaa; 64], "readable buffer untouched");
        // Two requests never see the same bytes.
        let c = d.alloc(32);
        d.post(0, &[(c, 32, true)]);
        d.notify(0);
        assert_eq!(d.used(0).map(|u| u.1), Some(32));
        assert_ne!(d.read(c, 32), d.read(a, 32));
    }
}
