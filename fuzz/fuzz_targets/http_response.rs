//! The guest's HTTP response parser (`roundtable-sandbox-guest-http`): any bytes from the
//! other end of the broker socket give a response within the body cap or an error, never a
//! panic, a hang or a read past the cap. Also the same bytes arriving one at a time (as
//! over a slow socket) give the same answer.
#![no_main]

use std::io::Read;

use libfuzzer_sys::fuzz_target;
use roundtable_sandbox_guest_http::{read_response, HttpError};

const MAX_BODY: usize = 4096;

/// A reader that hands out one byte per read.
struct Trickle<'a>(&'a [u8]);

impl Read for Trickle<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match (self.0.split_first(), buf.is_empty()) {
            (Some((b, rest)), false) => {
                buf[0] = *b;
                self.0 = rest;
                Ok(1)
            }
            _ => Ok(0),
        }
    }
}

fn summary(r: &Result<roundtable_sandbox_guest_http::Response, HttpError>) -> String {
    match r {
        Ok(r) => format!("{} {:?}", r.status, r.body),
        Err(e) => e.to_string(),
    }
}

fuzz_target!(|data: &[u8]| {
    let whole = read_response(data, MAX_BODY);
    if let Ok(r) = &whole {
        assert!(r.body.len() <= MAX_BODY);
        assert!((200..600).contains(&r.status), "{}", r.status);
    }
    let trickled = read_response(Trickle(data), MAX_BODY);
    assert_eq!(summary(&whole), summary(&trickled));
});
