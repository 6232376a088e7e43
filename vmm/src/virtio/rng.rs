//! virtio-rng: fills the guest's buffers from the host's `getrandom`, so
//! every VM — every clone of one snapshot included — draws its own entropy.

use virtio_queue::{Queue, QueueT};
use vm_memory::Bytes;

use super::VirtioDevice;
use crate::memory::GuestMem;

const DEVICE_RNG: u32 = 4;
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
        DEVICE_RNG
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
                tracing::warn!("virtio-rng: {e}");
                break;
            }
            used = true;
        }
        used
    }
}
