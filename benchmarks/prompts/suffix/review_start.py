def load_users(path):
    f = open(path)
    users = []
    for line in f.readlines():
        parts = line.split(",")
        name = parts[0]
        age = int(parts[1])
        email = parts[2]
        if age > 17:
            users.append({"name": name, "age": age, "email": email})
    return users


def average_age(users):
    total = 0
    for u in users:
        total = total + u["age"]
    return total / len(users)
