//! Reading the config file: a regular file of at most [`MAX_CONFIG_BYTES`], never anything that
//! could block or grow without end. The same reader serves the start, `rankgate check`, SIGHUP
//! and `POST /reload`: a path that points at a FIFO, a device such as `/dev/zero` or a file
//! that keeps growing is refused with its name and what it is, instead of wedging the reader
//! or filling memory.

use std::fs::{File, Metadata};
use std::io::{self, Read};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;

/// The largest config file read: a fleet at `MAX_WORKERS` written one short `[[engines]]` entry
/// each is a few MiB, but a file that size is a generated one that belongs in discovery or the
/// admin API; a hand-kept config is a few KiB. One byte more than this is read, to tell.
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// What a path is when it is not a regular file, for the error.
fn kind(meta: &Metadata) -> &'static str {
    let t = meta.file_type();
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a named pipe (FIFO)"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a regular file"
    }
}

fn refuse(meta: &Metadata, what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!("it is {}: {what} must be a regular file", kind(meta)),
    )
}

/// The config file's text, or why it cannot be used (the caller adds the path).
pub(super) fn read_text(path: &Path) -> io::Result<String> {
    let bytes = read_regular(path, MAX_CONFIG_BYTES, "a config file").map_err(|e| {
        match e.kind() == io::ErrorKind::FileTooLarge {
            true => too_large(e.to_string()),
            false => e,
        }
    })?;
    String::from_utf8(bytes).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("not UTF-8 text (byte {})", e.utf8_error().valid_up_to()),
        )
    })
}

/// The bytes of `path`, a regular file of at most `max` bytes (`what` names it in the errors):
/// never a FIFO, a device or a file that grows without end. Also for the files read again while
/// serving (TLS certificates and keys), so a path swapped for one of those cannot wedge a reload.
pub fn read_regular(path: &Path, max: u64, what: &str) -> io::Result<Vec<u8>> {
    // Looked at before opening: opening a FIFO for reading waits for a writer.
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(refuse(&meta, what));
    }
    // O_NONBLOCK in case the path was swapped for a FIFO since: the open returns at once, and
    // the opened file is looked at again before a byte is read.
    let file = File::options()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(refuse(&meta, what));
    }
    let over = |size: String| {
        io::Error::new(
            io::ErrorKind::FileTooLarge,
            format!("larger than {what} may be ({size}; at most {max} bytes)"),
        )
    };
    if meta.len() > max {
        return Err(over(format!("{} bytes", meta.len())));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    // At most one byte past the cap, whatever the file does while it is read.
    file.take(max + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(over("it grew while read".into()));
    }
    Ok(bytes)
}

fn too_large(e: String) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("{e}: a fleet that large belongs in [[discovery]] or the admin API"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("rankgate-read-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn only_a_regular_file_of_bounded_size_is_read() {
        let dir = scratch("kinds");
        let ok = dir.join("ok.toml");
        std::fs::write(&ok, "a = 1\n").unwrap();
        assert_eq!(read_text(&ok).unwrap(), "a = 1\n");

        let err = read_text(&dir).unwrap_err().to_string();
        assert!(err.contains("a directory"), "{err}");
        let err = read_text(Path::new("/dev/zero")).unwrap_err().to_string();
        assert!(err.contains("a character device"), "{err}");

        let fifo = dir.join("fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let err = read_text(&fifo).unwrap_err().to_string();
        assert!(err.contains("FIFO"), "{err}");

        let big = dir.join("big.toml");
        std::fs::write(&big, vec![b'#'; MAX_CONFIG_BYTES as usize + 1]).unwrap();
        let err = read_text(&big).unwrap_err().to_string();
        assert!(err.contains("larger than a config file may be"), "{err}");
        std::fs::write(&big, vec![b'#'; MAX_CONFIG_BYTES as usize]).unwrap();
        assert!(read_text(&big).is_ok());

        // Any file read this way says what it is for.
        let err = read_regular(&fifo, 10, "a TLS file")
            .unwrap_err()
            .to_string();
        assert!(err.contains("a TLS file must be a regular file"), "{err}");
        let err = read_regular(&big, 10, "a TLS file")
            .unwrap_err()
            .to_string();
        assert!(err.contains("larger than a TLS file may be"), "{err}");

        let bin = dir.join("bin.toml");
        std::fs::write(&bin, [b'a', 0xff]).unwrap();
        assert!(read_text(&bin).unwrap_err().to_string().contains("UTF-8"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
