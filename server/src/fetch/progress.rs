//! Download progress as log lines, one per tenth of a file: a pod's log shows that a large
//! download is moving without a terminal progress bar.

use hf_hub::api::Progress;
use tracing::info;

#[derive(Debug, Default)]
pub struct LogProgress {
    file: String,
    size: usize,
    done: usize,
    logged_tenths: usize,
}

impl LogProgress {
    /// Counts `n` more bytes and logs when a new tenth is reached.
    pub fn advance(&mut self, n: usize) {
        self.done += n;
        let tenths = (self.done * 10)
            .checked_div(self.size)
            .unwrap_or(10)
            .min(10);
        if tenths > self.logged_tenths {
            self.logged_tenths = tenths;
            info!(
                file = %self.file,
                bytes = self.done,
                total = self.size,
                "downloaded {}%",
                tenths * 10
            );
        }
    }

    /// Starts a file of `size` bytes.
    pub fn start(&mut self, size: usize, file: &str) {
        *self = Self {
            file: file.to_string(),
            size,
            ..Self::default()
        };
    }
}

impl Progress for LogProgress {
    fn init(&mut self, size: usize, filename: &str) {
        self.start(size, filename);
    }

    fn update(&mut self, size: usize) {
        self.advance(size);
    }

    fn finish(&mut self) {}
}
