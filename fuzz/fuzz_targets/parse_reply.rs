//! The strict parser of the guest's stdout: any bytes give a reply of the right shape or
//! a clear error, never a panic; a parsed failure is always marked as the guest's.
#![no_main]

use libfuzzer_sys::fuzz_target;
use roundtable_sandbox::internals::turn::{parse_reply, ReplyError, GUEST_ERROR_PREFIX};

fuzz_target!(|data: &[u8]| {
    let cap = 4096;
    match parse_reply(data, cap) {
        Ok(reply) => {
            assert!(data.len() <= cap);
            assert!(reply.check_shape().is_ok());
            if let Some(error) = &reply.error {
                assert!(error.starts_with(GUEST_ERROR_PREFIX));
            }
            // What was accepted is a JSON document that round-trips.
            let again = serde_json::to_vec(&reply).unwrap();
            let back: roundtable_sandbox::Reply = serde_json::from_slice(&again).unwrap();
            assert_eq!(back.ok, reply.ok);
        }
        Err(ReplyError::OutputTooLarge { .. }) => assert!(data.len() > cap),
        Err(ReplyError::MalformedOutput { reason }) => assert!(!reason.is_empty()),
        Err(other) => panic!("unexpected error kind: {other}"),
    }
});
