//! The operator's TOML: any text gives a config or a clear error, never a panic. A parsed
//! config's pure checks (limits, image reference) run too.
#![no_main]

use libfuzzer_sys::fuzz_target;
use roundtable_sandbox::internals::config::valid_image_reference;
use roundtable_sandbox::Config;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match Config::from_toml_str(text) {
        Ok(config) => {
            let _ = config.limits.validate();
            let _ = valid_image_reference(&config.image);
            // The key never comes from the file itself.
            assert!(!format!("{config:?}").contains("sk-"));
        }
        Err(e) => assert!(!e.to_string().is_empty()),
    }
});
