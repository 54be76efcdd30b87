#ifndef QF_FORMAT_SHA256_H
#define QF_FORMAT_SHA256_H

/* sha256 of a file as 64 lowercase hex digits + NUL (OpenSSL EVP, streamed in 1 MiB reads). */
int qf_sha256_file(const char *path, char hex[65]);

#endif
